//! Unit tests of the stats readers: /proc/net/dev, CPU rates from kept samples, memory usage,
//! the samples forgotten with their objects.

use super::*;

const NET_DEV: &str = "\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
lo:     560       8    0    0    0     0          0         0      560       8    0    0    0     0       0          0
  eth0:   12345      67    1    0    0     0          0         0     8910      11    2    0    0     0       0          0
  net1: 5 1 0 0 0 0 0 0 6 1 0 0 0 0 0 0
";

#[test]
fn net_dev_parses_without_loopback() {
    let got = parse_net_dev(NET_DEV);
    assert_eq!(
        got,
        vec![
            Interface {
                name: "eth0".into(),
                rx_bytes: 12345,
                rx_errors: 1,
                tx_bytes: 8910,
                tx_errors: 2,
            },
            Interface {
                name: "net1".into(),
                rx_bytes: 5,
                rx_errors: 0,
                tx_bytes: 6,
                tx_errors: 0,
            },
        ]
    );
    assert!(parse_net_dev("eth0: 1 2 3\n").is_empty());
}

#[test]
fn cpu_rate_from_the_kept_sample() {
    let s = 1_000_000_000i64;
    // First sample: no rate.
    let (r, k) = cpu_rate(None, 10 * s, 5_000);
    assert_eq!(r, None);
    // Two seconds later, one CPU-second more: half a core.
    let (r, k) = cpu_rate(Some(k), 12 * s, 5_000 + 1_000_000_000);
    assert_eq!(r, Some(500_000_000));
    // Too soon: the same rate, and the kept sample stays.
    let (r2, k2) = cpu_rate(Some(k), 12 * s + 1_000, 5_000 + 1_000_000_500);
    assert_eq!((r2, k2), (Some(500_000_000), k));
    // A counter that went back starts over.
    let (r, k) = cpu_rate(Some(k), 20 * s, 10);
    assert_eq!((r, k.usage_ns, k.rate), (None, 10, None));
    // Idle.
    let (r, _) = cpu_rate(Some(k), 25 * s, 10);
    assert_eq!(r, Some(0));
}

#[test]
fn memory_usage_only_has_available_under_a_limit() {
    let mut c = Counters {
        memory: Some(cgroups::Memory {
            usage: 100,
            working_set: 60,
            rss: 50,
            cache: 40,
            page_faults: 3,
            major_page_faults: 1,
            limit: None,
        }),
        ..Default::default()
    };
    let m = memory_usage(7, &c).unwrap();
    assert_eq!(m.timestamp, 7);
    assert_eq!(m.working_set_bytes, value(60));
    assert_eq!(m.usage_bytes, value(100));
    assert_eq!(m.available_bytes, None);
    c.memory.as_mut().unwrap().limit = Some(1000);
    assert_eq!(memory_usage(7, &c).unwrap().available_bytes, value(940));
    assert_eq!(memory_usage(7, &Counters::default()), None);
}

#[test]
fn state_forgets_removed_objects() {
    let dir = tempfile::tempdir().unwrap();
    let images = crate::images::fake::FakeImages::new(dir.path());
    let st = StatsState::new("/var/lib/minicri".into(), Arc::new(images));
    assert_eq!(st.cpu_rate("a", 0, 1), None);
    assert_eq!(st.cpu_rate("b", 0, 1), None);
    st.retain(&["a".to_string()].into());
    assert!(lock(&st.cpu).contains_key("a"));
    assert!(!lock(&st.cpu).contains_key("b"));
}
