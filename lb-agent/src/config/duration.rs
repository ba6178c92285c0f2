//! Go's `time.Duration` text form: [`parse_go_duration`] (`time.ParseDuration`) and
//! [`format_go_duration`] (`Duration.String()`).

use std::time::Duration;

/// Parses a Go duration string (`time.ParseDuration`): a sequence of decimal numbers, each with an
/// optional fraction and a unit (`ns`, `us`/`µs`, `ms`, `s`, `m`, `h`), with an optional sign; `0` alone
/// needs no unit. Negative durations are rejected (no kube-proxy duration may be negative).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let original = s;
    let s = s.trim();
    let (negative, mut rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(format!("invalid duration {original:?}"));
    }
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        let (int_part, tail) = rest.split_at(int_len);
        let (frac_part, tail) = match tail.strip_prefix('.') {
            Some(after) => {
                let len = after.find(|c: char| !c.is_ascii_digit()).unwrap_or(after.len());
                after.split_at(len)
            }
            None => ("", tail),
        };
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(format!("invalid duration {original:?}"));
        }
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let nanos_per_unit: u128 = match unit {
            "ns" => 1,
            "us" | "\u{00b5}s" | "\u{03bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err(format!("missing unit in duration {original:?}")),
            other => return Err(format!("unknown unit {other:?} in duration {original:?}")),
        };
        let int_value: u128 = if int_part.is_empty() {
            0
        } else {
            int_part
                .parse()
                .map_err(|_| format!("invalid duration {original:?}"))?
        };
        let mut nanos = int_value
            .checked_mul(nanos_per_unit)
            .ok_or_else(|| format!("duration {original:?} overflows"))?;
        if !frac_part.is_empty() {
            // Digits beyond nanosecond precision are dropped, as Go does.
            let digits = &frac_part[..frac_part.len().min(30)];
            let frac: u128 = digits
                .parse()
                .map_err(|_| format!("invalid duration {original:?}"))?;
            nanos += frac * nanos_per_unit / 10u128.pow(digits.len() as u32);
        }
        total = total
            .checked_add(nanos)
            .ok_or_else(|| format!("duration {original:?} overflows"))?;
        rest = next;
    }
    if total > u128::from(i64::MAX as u64) {
        return Err(format!("duration {original:?} overflows"));
    }
    if negative && total != 0 {
        return Err(format!("duration {original:?} is negative"));
    }
    Ok(Duration::from_nanos(total as u64))
}

/// Formats a duration as Go's `time.Duration.String()`: `0s`, `100ms`, `1.5s`, `1m30s`, `1h0m0s`.
pub fn format_go_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_string();
    }
    fn with_fraction(value: u128, unit: u128, digits: usize) -> String {
        let whole = value / unit;
        let fraction = value % unit;
        if fraction == 0 {
            whole.to_string()
        } else {
            let fraction = format!("{fraction:0digits$}");
            format!("{whole}.{}", fraction.trim_end_matches('0'))
        }
    }
    if nanos < 1_000 {
        return format!("{nanos}ns");
    }
    if nanos < 1_000_000 {
        return format!("{}\u{00b5}s", with_fraction(nanos, 1_000, 3));
    }
    if nanos < 1_000_000_000 {
        return format!("{}ms", with_fraction(nanos, 1_000_000, 6));
    }
    let total_secs = nanos / 1_000_000_000;
    let seconds = with_fraction(nanos % 60_000_000_000, 1_000_000_000, 9);
    let minutes = (total_secs / 60) % 60;
    let hours = total_secs / 3600;
    if hours > 0 {
        format!("{hours}h{minutes}m{seconds}s")
    } else if minutes > 0 {
        format!("{minutes}m{seconds}s")
    } else {
        format!("{seconds}s")
    }
}

#[cfg(test)]
mod tests;
