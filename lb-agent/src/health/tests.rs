//! The health timeout.

use super::*;

#[test]
fn health_timeout_is_twice_the_sync_period() {
    assert_eq!(
        health_timeout_for(Duration::from_secs(30)),
        Duration::from_secs(60)
    );
}
