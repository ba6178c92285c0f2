//! Go duration parsing and formatting.

use super::*;

#[test]
fn go_durations() {
    let ok = |s: &str, d: Duration| assert_eq!(parse_go_duration(s), Ok(d), "{s}");
    ok("0", Duration::ZERO);
    ok("0s", Duration::ZERO);
    ok("-0s", Duration::ZERO);
    ok("100ms", Duration::from_millis(100));
    ok("30s", Duration::from_secs(30));
    ok("1m30s", Duration::from_secs(90));
    ok("1h0m0s", Duration::from_secs(3600));
    ok("2h22m", Duration::from_secs(2 * 3600 + 22 * 60));
    ok("1.5s", Duration::from_millis(1500));
    ok(".5s", Duration::from_millis(500));
    ok("1.s", Duration::from_secs(1));
    ok("+5s", Duration::from_secs(5));
    ok("10us", Duration::from_micros(10));
    ok("10\u{00b5}s", Duration::from_micros(10));
    ok("10\u{03bc}s", Duration::from_micros(10));
    ok("7ns", Duration::from_nanos(7));
    ok("1.0000000001s", Duration::from_secs(1));
    for bad in ["", "5", "s", "1x", "-1s", "1m-5s", ".s", "1..5s", "9999999999h"] {
        assert!(parse_go_duration(bad).is_err(), "{bad:?} should not parse");
    }
}

#[test]
fn go_duration_strings() {
    let f = |d: Duration| format_go_duration(d);
    assert_eq!(f(Duration::ZERO), "0s");
    assert_eq!(f(Duration::from_nanos(7)), "7ns");
    assert_eq!(f(Duration::from_nanos(1500)), "1.5\u{00b5}s");
    assert_eq!(f(Duration::from_millis(100)), "100ms");
    assert_eq!(f(Duration::from_micros(1500)), "1.5ms");
    assert_eq!(f(Duration::from_secs(1)), "1s");
    assert_eq!(f(Duration::from_millis(1500)), "1.5s");
    assert_eq!(f(Duration::from_secs(90)), "1m30s");
    assert_eq!(f(Duration::from_secs(15 * 60)), "15m0s");
    assert_eq!(f(Duration::from_secs(3600)), "1h0m0s");
    assert_eq!(f(Duration::from_secs(24 * 3600 + 1)), "24h0m1s");
    for d in [
        Duration::from_millis(1),
        Duration::from_millis(61_500),
        Duration::from_secs(7322),
    ] {
        assert_eq!(parse_go_duration(&f(d)), Ok(d));
    }
}
