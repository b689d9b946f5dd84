//! Hears the scheduler's revocations as they happen, through the daemon's own log events (each
//! names the flow a slot was taken from and the flow it was taken for), for the half of
//! invariant (7) a step cannot see: a revocation and the grant that follows it happen within one
//! instant.
//!
//! [`Revocations`] is the scenario thread's tracing subscriber while the scenario runs (its
//! runtime runs every task on that thread).

use std::sync::{Arc, Mutex, Weak};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

use super::world::Sim;

/// The subscriber: the simulation it reports to, once there is one.
#[derive(Default)]
pub(super) struct Revocations {
    pub sim: Mutex<Weak<Sim>>,
}

/// The `flow` and `for_flow` fields of an event.
#[derive(Default)]
struct Fields {
    flow: Option<u64>,
    for_flow: Option<u64>,
}

impl Visit for Fields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "flow" => self.flow = Some(value),
            "for_flow" => self.for_flow = Some(value),
            _ => {}
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl Subscriber for Revocations {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target() == "minicri_store::sched"
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let (Some(victim), Some(for_flow)) = (f.flow, f.for_flow) else {
            return;
        };
        let Some(sim) = self.sim.lock().unwrap().upgrade() else {
            return;
        };
        sim.revoked(victim, for_flow);
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// A subscriber for one scenario.
pub(super) fn subscriber() -> Arc<Revocations> {
    Arc::new(Revocations::default())
}
