//! The document lists every kernel, each fallback, the programs and the binaries.

use serde_json::json;

use super::*;

#[test]
fn the_doc_lists_every_kernel_and_fallback() {
    let summary = |release: &str, ok: bool, fallback: bool| {
        json!({
            "release": release, "package": format!("linux-image-{release}"), "version": "1",
            "guest": "TCG", "ok": ok, "aborted": null, "seconds": 600.0, "commit": "abc", "date": "d",
            "features": {"minimum": "5.10", "features": [
                {"name": "TCX", "since": "6.6", "present": !fallback, "fallback": "clsact filters"}
            ], "programs": [
                {"name": "lb_tc_ingress", "instructions": 9000,
                 "verified_instructions": if fallback { json!(null) } else { json!(20000) }}
            ]},
            "results": [{"binary": "tc_fixtures", "ok": ok, "passed": 21, "failed": u64::from(!ok),
                         "seconds": 12.0, "failures": if ok { json!([]) } else { json!(["x"]) }}],
        })
    };
    let doc = render_doc(&[
        summary("6.1.0-56-amd64", true, true),
        summary("6.12.117+deb13-amd64", false, false),
    ]);
    assert!(doc.contains("older than 5.10"), "{doc}");
    assert!(
        doc.contains(
            "| 6.1.0-56-amd64 | linux-image-6.1.0-56-amd64 1 | passed | 21 passed, 0 failed | TCX (6.6) |"
        ),
        "{doc}"
    );
    assert!(doc.contains("- **TCX** (Linux 6.6): clsact filters."), "{doc}");
    assert!(doc.contains("| lb_tc_ingress | 9000 | 9000 / 20000 |"), "{doc}");
    assert!(
        doc.contains("| tc_fixtures | 21 passed (12 s) | **FAILED** x |"),
        "{doc}"
    );
}
