//! Go's time format, around leap years and before the epoch.

use std::time::{Duration, UNIX_EPOCH};

use super::*;

#[test]
fn go_time_format() {
    assert_eq!(format_go_time(None), "0001-01-01T00:00:00Z");
    assert_eq!(format_go_time(Some(UNIX_EPOCH)), "1970-01-01T00:00:00Z");
    assert_eq!(
        format_go_time(Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))),
        "2023-11-14T22:13:20Z"
    );
    assert_eq!(
        format_go_time(Some(UNIX_EPOCH + Duration::new(1_700_000_000, 120_000_000))),
        "2023-11-14T22:13:20.12Z"
    );
    assert_eq!(
        format_go_time(Some(UNIX_EPOCH + Duration::new(951_782_400, 1))),
        "2000-02-29T00:00:00.000000001Z"
    );
    assert_eq!(
        format_go_time(Some(UNIX_EPOCH + Duration::from_secs(4_107_542_400))),
        "2100-03-01T00:00:00Z"
    );
    assert_eq!(
        format_go_time(Some(UNIX_EPOCH - Duration::from_secs(1))),
        "1969-12-31T23:59:59Z"
    );
}
