//! bpftool, as the tests run it against the agent's pins: what an SRE reads is what they assert.

use std::{ffi::OsStr, process::Command};

use serde_json::Value;

/// `bpftool <args>`: its standard output; fails the test with its output when it fails.
pub fn run<S: AsRef<OsStr>>(args: &[S]) -> String {
    let out = Command::new("bpftool")
        .args(args)
        .output()
        .expect("bpftool (run the tests through ./x test, which installs it)");
    let words: Vec<_> = args.iter().map(|a| a.as_ref().to_string_lossy()).collect();
    assert!(
        out.status.success(),
        "bpftool {}: {}{}",
        words.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `bpftool -j <args>`, parsed; fails the test when bpftool fails.
pub fn json<S: AsRef<OsStr>>(args: &[S]) -> Value {
    let mut all: Vec<&OsStr> = vec!["-j".as_ref()];
    all.extend(args.iter().map(AsRef::as_ref));
    let out = run(&all);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("bpftool's JSON ({e}): {out}"))
}

/// `bpftool -j <args>`, parsed, or `Value::Null` when it fails: for objects that may go away
/// while they are read (a program replaced under the reader).
pub fn json_or_null<S: AsRef<OsStr>>(args: &[S]) -> Value {
    Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| serde_json::from_slice(&out.stdout).ok())
        .unwrap_or(Value::Null)
}
