//! Guessing which experts the layers ahead will need, and judging whether the guesses are worth reading.
//!
//! A wrong guess costs a read the disk could have spent on a miss, and a slot; on big real models cross-layer
//! guesses are right only ~50% of the time and have lost throughput (field notes §6). So under `auto` the
//! guesses are always made (a router matmul per layer ahead, cheap) and scored against the routes the layers
//! then take, but read only while their recent precision is at least [`AUTO_MIN_PRECISION`].

/// Which records the store is asked to read ahead of the layers that need them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PrefetchMode {
    /// `next-layer` when experts stream from disk, read only while the guesses prove right (else `none`).
    #[default]
    Auto,
    /// No speculative reads.
    None,
    /// The layers ahead get the experts the previous token used there.
    PrevToken,
    /// The layers ahead get what their routers pick for the current residual stream.
    NextLayer,
}

impl std::str::FromStr for PrefetchMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            "prev-token" => Ok(Self::PrevToken),
            "next-layer" => Ok(Self::NextLayer),
            _ => Err(format!(
                "unknown prefetch mode `{s}` (auto, none, prev-token, next-layer)"
            )),
        }
    }
}

/// Under `auto`, guesses are read while at least this share of the guessed experts was then used. Between the
/// field's 53% that lost 38% (flash-moe) and the 62–90% that won here (README, "Prefetch").
pub const AUTO_MIN_PRECISION: f64 = 0.6;

/// Weight of the older history per scored layer: the precision follows the last few hundred layer steps.
const DECAY: f64 = 0.995;

/// Guessed experts scored before the precision gates anything (until then guesses are read).
const WARMUP: f64 = 32.0;

/// The running precision of the guesses of one model.
#[derive(Debug, Default)]
pub(crate) struct GuessBook {
    /// Per decoder layer: the latest guess for it, not yet scored.
    pending: Vec<Vec<usize>>,
    /// Decayed count of guessed experts the layer then used.
    right: f64,
    /// Decayed count of guessed experts.
    guessed: f64,
}

impl GuessBook {
    /// Remembers `guess` (ascending) as the latest for decoder layer `layer`.
    pub fn record(&mut self, layer: usize, guess: &[usize]) {
        if self.pending.len() <= layer {
            self.pending.resize(layer + 1, Vec::new());
        }
        self.pending[layer].clear();
        self.pending[layer].extend_from_slice(guess);
    }

    /// Scores the pending guess for `layer` against the experts it used (ascending); returns (guessed,
    /// used) expert counts.
    pub fn score(&mut self, layer: usize, used: &[usize]) -> (usize, usize) {
        let Some(guess) = self.pending.get_mut(layer).filter(|g| !g.is_empty()) else {
            return (0, 0);
        };
        let right = guess.iter().filter(|e| used.binary_search(e).is_ok()).count();
        self.right = self.right * DECAY + right as f64;
        self.guessed = self.guessed * DECAY + guess.len() as f64;
        let guessed = guess.len();
        guess.clear();
        (guessed, right)
    }

    /// Recent share of guessed experts that were used (`None` before any was scored).
    pub fn precision(&self) -> Option<f64> {
        (self.guessed > 0.0).then(|| self.right / self.guessed)
    }

    /// Whether guesses should be read, for a minimum precision `min` (`None`: always).
    pub fn open(&self, min: Option<f64>) -> bool {
        match min {
            None => true,
            Some(min) => self.guessed < WARMUP || self.precision().is_some_and(|p| p >= min),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guesses_are_read_only_while_they_prove_right() {
        let mut b = GuessBook::default();
        assert!(b.open(Some(AUTO_MIN_PRECISION)) && b.precision().is_none());
        // Half right, long enough to leave the warm-up: the gate closes; forced modes still read.
        for _ in 0..40 {
            b.record(3, &[1, 2, 5, 7]);
            b.score(3, &[1, 2, 4, 6]);
        }
        assert!((b.precision().unwrap() - 0.5).abs() < 1e-9);
        assert!(!b.open(Some(AUTO_MIN_PRECISION)));
        assert!(b.open(None));
        // A layer with no pending guess scores nothing; a scored guess is not scored twice.
        b.score(3, &[]);
        b.score(9, &[1]);
        assert!((b.precision().unwrap() - 0.5).abs() < 1e-9);
        // Guesses that turn right reopen it.
        for _ in 0..200 {
            b.record(0, &[2, 3]);
            b.score(0, &[2, 3, 8]);
        }
        assert!(b.precision().unwrap() > 0.9 && b.open(Some(AUTO_MIN_PRECISION)));
    }
}
