//! How the sandbox stops: the SIGINT, SIGTERM and SIGHUP handler and the flag it sets, the
//! check made while starting, and progress messages on stderr that never panic (after a hang-up
//! stdout and stderr go to /dev/null).

use std::{
    io::Write,
    sync::atomic::{AtomicBool, AtomicI32, Ordering},
};

use anyhow::{Result, bail};

pub(crate) static STOP: AtomicBool = AtomicBool::new(false);
pub(crate) static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Whether stdout and stderr are terminals (set at start, read by the signal handler).
pub(crate) static TTY_OUT: AtomicBool = AtomicBool::new(false);
pub(crate) static TTY_ERR: AtomicBool = AtomicBool::new(false);

pub(crate) extern "C" fn on_signal(sig: libc::c_int) {
    if sig == libc::SIGHUP {
        // The terminal is gone: what was written to it goes nowhere from here on, rather than
        // failing (children inherit stderr; a failed write must not stop the teardown).
        // SAFETY: open, dup2 and close are async-signal-safe.
        unsafe {
            let fd = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
            if fd >= 0 {
                if TTY_OUT.load(Ordering::SeqCst) {
                    libc::dup2(fd, 1);
                }
                if TTY_ERR.load(Ordering::SeqCst) {
                    libc::dup2(fd, 2);
                }
                libc::close(fd);
            }
        }
    }
    SIGNAL.store(sig, Ordering::SeqCst);
    STOP.store(true, Ordering::SeqCst);
}

/// Prints to stderr, never panicking (the terminal may be gone).
pub(crate) fn say(message: &str) {
    let _ = writeln!(std::io::stderr(), "{message}");
}

pub(crate) fn step(message: &str) {
    say(&format!("==> {message}"));
}

/// Fails when a signal asked the sandbox to stop while it was starting.
pub(crate) fn check_stop() -> Result<()> {
    if STOP.load(Ordering::SeqCst) {
        bail!(Interrupted);
    }
    Ok(())
}

/// Stopped by a signal before it was ready (not a failure).
#[derive(Debug)]
pub(crate) struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped while starting")
    }
}
