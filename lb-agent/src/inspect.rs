//! Operator commands that read the pinned maps: `lb-agent services`, `lb-agent backends`.
//! They work while the agent runs and after it stopped (the maps are pinned).

use anyhow::Result;

use crate::cli::InspectArgs;

pub fn services(_args: &InspectArgs) -> Result<()> {
    anyhow::bail!("lb-agent services: not available yet")
}

pub fn backends(_args: &InspectArgs) -> Result<()> {
    anyhow::bail!("lb-agent backends: not available yet")
}
