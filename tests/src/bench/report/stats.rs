//! Statistics over rounds (median, nearest-rank percentile, min and max) and the number
//! formats of the document and the summary.

pub fn median(v: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// Nearest-rank percentile.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[idx])
}

pub(super) fn min_max(v: &[f64]) -> Option<(f64, f64)> {
    let v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    Some((
        v.iter().copied().fold(f64::INFINITY, f64::min),
        v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    ))
}

pub(super) fn num(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// "median (min–max)".
pub(super) fn spread(v: &[f64]) -> String {
    match (median(v), min_max(v)) {
        (Some(m), Some((lo, hi))) if v.len() > 1 => format!("{} ({}–{})", num(m), num(lo), num(hi)),
        (Some(m), _) => num(m),
        _ => "–".into(),
    }
}

pub(super) fn opt_s(v: Option<f64>) -> String {
    match v {
        Some(s) if s < 1.0 => format!("{} ms", num(s * 1e3)),
        Some(s) => format!("{} s", num(s)),
        None => "did not finish".into(),
    }
}

pub(super) fn fmt_n(n: u32) -> String {
    if n >= 1000 {
        format!("{},{:03}", n / 1000, n % 1000)
    } else {
        n.to_string()
    }
}

pub(super) fn mib(kib: f64) -> String {
    format!("{:.1}", kib / 1024.0)
}
