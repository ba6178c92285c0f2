//! Go's JSON form of a UTC `time.Time` ([`format_go_time`]), for the health bodies' timestamps.

use std::time::SystemTime;

/// Formats a time as Go's `json.Marshal(time.Time)` does for a UTC time (`time.RFC3339Nano`: the fraction
/// without trailing zeros, and none when whole). `None` is Go's zero time, `0001-01-01T00:00:00Z`.
pub fn format_go_time(t: Option<SystemTime>) -> String {
    // jiff (k8s-openapi's time type) prints RFC 3339 in UTC with the shortest exact fraction,
    // which is Go's RFC3339Nano.
    t.and_then(|t| k8s_openapi::jiff::Timestamp::try_from(t).ok())
        .map_or_else(|| "0001-01-01T00:00:00Z".to_string(), |ts| ts.to_string())
}

#[cfg(test)]
mod tests;
