//! The model families kvflow runs, in one table (DESIGN §6). Each entry states whether the
//! family keeps per-request recurrent state; the handoff, prefix reuse and speculative rollback
//! all depend on that answer, so it is never defaulted.

use std::fmt;

/// A model family: what the executor computes and what a request's state is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Grouped-query attention with a paged KV cache (llama, qwen3).
    Mha,
    /// Multi-head latent attention: the cache holds the normalised latent and the rope key
    /// (deepseek_v3).
    Mla,
    /// MLA whose queries attend to the keys a top-k indexer picks; the cache also holds index
    /// keys (deepseek_v32).
    SparseMla,
    /// Gated DeltaNet linear attention with gated full-attention layers every few layers
    /// (qwen3_next).
    HybridGdn,
    /// Gated DeltaNet only: no paged KV at all (qwen3_next whose layers are all linear).
    Gdn,
    /// Kimi Delta Attention layers with MLA layers (kimi_linear).
    HybridKda,
}

/// One row of the family table.
#[derive(Clone, Copy, Debug)]
pub struct FamilyInfo {
    pub family: Family,
    pub name: &'static str,
    /// Hugging Face `model_type`s served by this family.
    pub model_types: &'static [&'static str],
    pub has_paged_kv: bool,
    pub has_recurrent_state: bool,
}

/// Every family, stated once.
pub const FAMILIES: &[FamilyInfo] = &[
    FamilyInfo {
        family: Family::Mha,
        name: "mha",
        model_types: &["llama", "qwen3"],
        has_paged_kv: true,
        has_recurrent_state: false,
    },
    FamilyInfo {
        family: Family::Mla,
        name: "mla",
        model_types: &["deepseek_v3"],
        has_paged_kv: true,
        has_recurrent_state: false,
    },
    FamilyInfo {
        family: Family::SparseMla,
        name: "sparse_mla",
        model_types: &["deepseek_v32"],
        has_paged_kv: true,
        has_recurrent_state: false,
    },
    FamilyInfo {
        family: Family::HybridGdn,
        name: "hybrid_gdn",
        model_types: &["qwen3_next"],
        has_paged_kv: true,
        has_recurrent_state: true,
    },
    FamilyInfo {
        family: Family::Gdn,
        name: "gdn",
        // qwen3_next whose layer_types are all linear_attention (see `Family::detect`)
        model_types: &[],
        has_paged_kv: false,
        has_recurrent_state: true,
    },
    FamilyInfo {
        family: Family::HybridKda,
        name: "hybrid_kda",
        model_types: &["kimi_linear"],
        has_paged_kv: true,
        has_recurrent_state: true,
    },
];

impl Family {
    /// Every variant; `variant_index` keeps this list honest (a new variant breaks its match).
    pub const ALL: &'static [Family] =
        &[Family::Mha, Family::Mla, Family::SparseMla, Family::HybridGdn, Family::Gdn, Family::HybridKda];

    /// Position in [`Family::ALL`]. Exhaustive on purpose: adding a family fails to compile here
    /// until it is listed, and the table test then fails until it has a row in [`FAMILIES`].
    pub const fn variant_index(self) -> usize {
        match self {
            Family::Mha => 0,
            Family::Mla => 1,
            Family::SparseMla => 2,
            Family::HybridGdn => 3,
            Family::Gdn => 4,
            Family::HybridKda => 5,
        }
    }

    /// This family's row of [`FAMILIES`].
    pub fn info(self) -> &'static FamilyInfo {
        FAMILIES.iter().find(|f| f.family == self).unwrap_or_else(|| panic!("family {self:?} has no row in FAMILIES"))
    }

    pub fn has_recurrent_state(self) -> bool {
        self.info().has_recurrent_state
    }

    pub fn has_paged_kv(self) -> bool {
        self.info().has_paged_kv
    }

    pub fn name(self) -> &'static str {
        self.info().name
    }

    /// The family serving a Hugging Face `model_type`, if any. (A qwen3_next checkpoint whose
    /// layers are all linear is `Gdn`; the model builder decides that from `layer_types`.)
    pub fn for_model_type(model_type: &str) -> Option<Family> {
        FAMILIES.iter().find(|f| f.model_types.contains(&model_type)).map(|f| f.family)
    }

    /// Every supported `model_type`, comma-separated (for error messages).
    pub fn supported_model_types() -> String {
        FAMILIES.iter().flat_map(|f| f.model_types.iter().copied()).collect::<Vec<_>>().join(", ")
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_exactly_one_row_stating_its_recurrent_state() {
        for (i, family) in Family::ALL.iter().enumerate() {
            assert_eq!(family.variant_index(), i, "Family::ALL is out of order at {family:?}");
            let rows = FAMILIES.iter().filter(|f| f.family == *family).count();
            assert_eq!(rows, 1, "{family:?} must have exactly one row in FAMILIES");
        }
        assert_eq!(FAMILIES.len(), Family::ALL.len());
    }

    #[test]
    fn model_types_map_to_one_family() {
        let mut seen = std::collections::HashSet::new();
        for f in FAMILIES {
            for t in f.model_types {
                assert!(seen.insert(*t), "model_type {t} is claimed twice");
            }
        }
        assert_eq!(Family::for_model_type("qwen3"), Some(Family::Mha));
        assert_eq!(Family::for_model_type("gpt2"), None);
    }
}
