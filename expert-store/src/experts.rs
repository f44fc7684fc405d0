//! Expert records: "the bytes of expert e in layer l", whatever the storage.

use std::collections::HashMap;
use std::sync::Arc;

use crate::{Checkpoint, OwnedBytes, StoreError};

/// The bytes of one expert: its parts in the order the layer's [`StackedExperts::tensors`] lists them.
#[derive(Debug, Clone)]
pub struct ExpertRecord {
    /// One byte range per component tensor (e.g. gate weight, gate scales, ..., down biases).
    pub parts: Vec<OwnedBytes>,
}

impl ExpertRecord {
    /// Total bytes of the record.
    pub fn len(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }

    /// True when the record holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Serves expert records by (layer, expert).
pub trait ExpertSource: Send + Sync {
    /// The record of expert `expert` in layer `layer`.
    fn read_expert(&self, layer: usize, expert: usize) -> Result<ExpertRecord, StoreError>;
}

/// One layer's experts stored stacked: each named tensor has the expert index as its leading dimension.
#[derive(Debug, Clone)]
pub struct StackedExperts {
    /// Layer index.
    pub layer: usize,
    /// Number of experts stacked in each tensor.
    pub num_experts: usize,
    /// Component tensor names, in record order.
    pub tensors: Vec<String>,
}

/// Views expert slices of stacked tensors straight from the mmap'd checkpoint (no copy, no packing).
pub struct MmapExpertSource {
    /// Per layer: per component, the whole stacked tensor and one expert's stride in bytes.
    layers: HashMap<usize, Vec<(OwnedBytes, usize)>>,
    num_experts: HashMap<usize, usize>,
}

impl MmapExpertSource {
    /// Indexes the given layers; every tensor must exist with leading dimension `num_experts`.
    pub fn new(ckpt: &Arc<Checkpoint>, layout: &[StackedExperts]) -> Result<Self, StoreError> {
        let mut layers = HashMap::new();
        let mut num_experts = HashMap::new();
        for l in layout {
            let mut comps = Vec::with_capacity(l.tensors.len());
            for name in &l.tensors {
                let t = ckpt.require(name)?;
                let bad = |message: String| StoreError::BadTensor {
                    name: name.clone(),
                    message,
                };
                if t.shape.first() != Some(&l.num_experts) {
                    return Err(bad(format!(
                        "expected {} stacked experts, shape is {:?}",
                        l.num_experts, t.shape
                    )));
                }
                let total = t.bytes().len();
                if l.num_experts == 0 || total % l.num_experts != 0 {
                    return Err(bad(format!(
                        "{total} bytes do not split into {} experts",
                        l.num_experts
                    )));
                }
                comps.push((t.bytes().clone(), total / l.num_experts));
            }
            layers.insert(l.layer, comps);
            num_experts.insert(l.layer, l.num_experts);
        }
        Ok(Self {
            layers,
            num_experts,
        })
    }
}

impl ExpertSource for MmapExpertSource {
    fn read_expert(&self, layer: usize, expert: usize) -> Result<ExpertRecord, StoreError> {
        let missing = || StoreError::NoRecord { layer, expert };
        let comps = self.layers.get(&layer).ok_or_else(missing)?;
        if expert >= self.num_experts[&layer] {
            return Err(missing());
        }
        let parts = comps
            .iter()
            .map(|(whole, stride)| {
                whole
                    .slice(expert * stride..(expert + 1) * stride)
                    .ok_or_else(missing)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ExpertRecord { parts })
    }
}
