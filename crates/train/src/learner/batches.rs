//! Where the steps' batches come from: the data loader, or (for benchmarks) the first batch
//! again and again.

use anyhow::{Context, Result};
use data::loader::{Batch, Loader};

/// Where the steps' batches come from.
pub(super) enum Batches {
    /// The data loader; with `repeat_first`, it makes only the first batch.
    Loader { loader: Loader, repeat_first: bool },
    /// The first batch again ([`RunOptions::repeat_first_batch`]); the loader has stopped.
    Repeat(Batch),
}

impl Batches {
    pub(super) fn next(&mut self) -> Result<Batch> {
        match self {
            Batches::Repeat(batch) => Ok(batch.clone()),
            Batches::Loader {
                loader,
                repeat_first,
            } => {
                let repeat = *repeat_first;
                let batch = loader.next().context("the data loader stopped")??;
                if repeat {
                    // drops the loader, which joins its workers
                    *self = Batches::Repeat(batch.clone());
                }
                Ok(batch)
            }
        }
    }
}
