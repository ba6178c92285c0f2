//! `lb-agent trace`: what the data path does with one packet.

use anyhow::Result;

use crate::cli::TraceArgs;

pub fn run(_args: &TraceArgs) -> Result<()> {
    anyhow::bail!("lb-agent trace: not available yet")
}
