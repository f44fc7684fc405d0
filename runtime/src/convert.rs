//! `sluice convert`: pack a model directory's experts into a store, streaming one record at a time.

use std::path::Path;

use expert_store::PackedStore;

use crate::error::{ModelError, Result};

/// Packs the experts of the model directory `dir` into a store at `out` (see [`expert_store::convert`]).
pub fn convert_model(dir: &Path, out: &Path, force: bool, progress: &dyn Fn(u64, u64)) -> Result<PackedStore> {
    if expert_store::is_store(dir) {
        return Err(ModelError::InvalidArgument(format!(
            "{} is already a packed store; convert the original model directory",
            dir.display()
        )));
    }
    // The expert stacks come from the config and the checkpoint's tensor index alone: no model is built and
    // nothing is read before `convert` streams each record from the checkpoint to the store.
    let config = crate::config::ModelConfig::load(dir)?;
    let weights = crate::weights::Weights::open(dir, config)?;
    let arch = crate::models::describe(&weights)?;
    let (_, stacks) = arch.expert_layouts(&weights)?;
    if stacks.is_empty() {
        return Err(ModelError::InvalidArgument(format!(
            "{} has no routed experts to pack",
            dir.display()
        )));
    }
    Ok(expert_store::convert(
        weights.checkpoint(),
        &stacks,
        out,
        &expert_store::ConvertOptions { force, progress },
    )?)
}
