//! What the configuration sections this crate owns (`[pull]` in `pull/settings.rs`,
//! `[registry]` in `registry/settings.rs`) share: how a number of seconds is read.

use std::time::Duration;

/// A number of seconds of a section: `0` turns the setting off. `key` names it in the error.
pub fn seconds_or_off(key: &str, t: f64) -> Result<Option<Duration>, String> {
    if !t.is_finite() || !(0.0..=1e9).contains(&t) {
        return Err(format!(
            "{key} must be a number of seconds, 0 to 1000000000"
        ));
    }
    Ok((t > 0.0).then(|| Duration::from_secs_f64(t)))
}
