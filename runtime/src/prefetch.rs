//! Guessing which experts the layers ahead will need, and judging whether the guesses are worth reading.
//!
//! A wrong guess costs a read the disk could have spent on a miss, and a slot; on big real models cross-layer
//! guesses are right only ~50% of the time and have lost throughput (field notes §6). So under `auto` the
//! guesses are always made (a router matmul per layer ahead, cheap) and scored against the routes the layers
//! then take, per (layers ahead, rank in the router's order): a guess is read only while the recent precision
//! of its distance and rank is at least [`AUTO_MIN_PRECISION`]. The router's first choice for the next layer
//! is right far more often than its last, or than any guess from further back.
//!
//! A decode step that waits on the disk guesses the next layer again once the experts it had at hand are
//! computed: the residual stream then holds most of this layer's output, which is what moves the next
//! router's choice most. That refined guess (distance 0 here) replaces the next layer's guesses still queued.

/// Which records the store is asked to read ahead of the layers that need them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PrefetchMode {
    /// `next-layer` when experts stream from disk, reading only the guesses whose distance and rank prove right.
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

/// Weight of the older history per scored guess: a precision follows its last few hundred scored guesses.
const DECAY: f64 = 0.995;

/// Guessed experts scored before a precision gates anything (until then guesses are read).
const WARMUP: f64 = 32.0;

/// Decayed counts of guessed experts and of those then used.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    right: f64,
    guessed: f64,
}

impl Tally {
    fn add(&mut self, guessed: usize, right: usize) {
        self.right = self.right * DECAY + right as f64;
        self.guessed = self.guessed * DECAY + guessed as f64;
    }

    fn precision(&self) -> Option<f64> {
        (self.guessed > 0.0).then(|| self.right / self.guessed)
    }

    /// Still warming up, or at least `min` precise.
    fn passes(&self, min: f64) -> bool {
        self.guessed < WARMUP || self.precision().is_some_and(|p| p >= min)
    }
}

/// One guessed expert: the expert and its rank in the router's order (0: the router's first choice).
pub(crate) type RankedGuess = (usize, usize);

/// The running precision of the guesses of one model: overall (for the nearest guess of each layer) and per
/// (layers ahead, rank), since a layer's guess from further back, or of a lower rank, is right less often.
#[derive(Debug, Default)]
pub(crate) struct GuessBook {
    /// Per decoder layer, per distance (layers ahead; 0 for the refined next-layer guess): the latest guess for
    /// it, not yet scored.
    pending: Vec<Vec<Vec<RankedGuess>>>,
    /// The nearest guess of each scored layer step.
    nearest: Tally,
    /// Per distance (0: refined), per rank.
    cells: Vec<Vec<Tally>>,
}

impl GuessBook {
    /// Remembers `guess` as the latest made `distance` layers ahead of decoder layer `layer` (0: the refined
    /// guess, made in the layer before once its experts at hand were computed).
    pub fn record(&mut self, layer: usize, distance: usize, guess: &[RankedGuess]) {
        if self.pending.len() <= layer {
            self.pending.resize(layer + 1, Vec::new());
        }
        let (slots, d) = (&mut self.pending[layer], distance);
        if slots.len() <= d {
            slots.resize(d + 1, Vec::new());
        }
        let slot = &mut slots[d];
        slot.clear();
        slot.extend_from_slice(guess);
    }

    /// Scores the pending guesses for `layer` against the experts it used (ascending); returns (guessed,
    /// used) expert counts of the nearest one made from the stream after attention (distance ≥ 1: a refined
    /// guess is scored in its own cells only, so the overall precision keeps meaning what a prompt's guess
    /// gets).
    pub fn score(&mut self, layer: usize, used: &[usize]) -> (usize, usize) {
        let Some(slots) = self.pending.get_mut(layer) else {
            return (0, 0);
        };
        let mut nearest = None;
        for (d, guess) in slots.iter_mut().enumerate().filter(|(_, g)| !g.is_empty()) {
            if self.cells.len() <= d {
                self.cells.resize(d + 1, Vec::new());
            }
            let cells = &mut self.cells[d];
            let mut right = 0;
            for &(e, rank) in guess.iter() {
                if cells.len() <= rank {
                    cells.resize(rank + 1, Tally::default());
                }
                let hit = used.binary_search(&e).is_ok();
                cells[rank].add(1, usize::from(hit));
                right += usize::from(hit);
            }
            if d > 0 {
                nearest.get_or_insert((guess.len(), right));
            }
            guess.clear();
        }
        let Some((guessed, right)) = nearest else {
            return (0, 0);
        };
        self.nearest.add(guessed, right);
        (guessed, right)
    }

    /// Recent share of the nearest guesses' experts that were used (`None` before any was scored).
    pub fn precision(&self) -> Option<f64> {
        self.nearest.precision()
    }

    /// Whether a prompt's guesses should be read, for a minimum precision `min` (`None`: always): while the
    /// nearest guesses as a whole are at least that precise (a prompt's guess is the union over its rows, with
    /// no rank worth gating on).
    pub fn open(&self, min: Option<f64>) -> bool {
        min.is_none_or(|min| self.nearest.passes(min))
    }

    /// Recent precision per distance (0: the refined next-layer guess) and rank (from the router's first
    /// choice).
    pub fn precision_by_rank(&self) -> Vec<Vec<Option<f64>>> {
        (self.cells.iter())
            .map(|c| c.iter().map(Tally::precision).collect())
            .collect()
    }

    /// Whether a guess of rank `rank` made `distance` layers ahead is worth reading, for a minimum precision
    /// `min` (`None`: always): its cell's recent precision is at least `min`, or the cell is still warming up.
    pub fn wanted(&self, distance: usize, rank: usize, min: Option<f64>) -> bool {
        let Some(min) = min else {
            return true;
        };
        let cell = (self.cells.get(distance)).and_then(|c| c.get(rank));
        cell.is_none_or(|c| c.passes(min))
    }
}

/// The union of per-row guesses (each best first, experts below `num_experts`) in rank order: every row's first
/// choice, then every row's second, and so on; an expert keeps its best rank.
pub(crate) fn merge_ranked(rows: &[Vec<usize>], num_experts: usize) -> Vec<RankedGuess> {
    let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut seen = vec![false; num_experts];
    let mut out: Vec<RankedGuess> = Vec::new();
    for rank in 0..longest {
        for e in rows.iter().filter_map(|r| r.get(rank).copied()) {
            if seen.get(e) == Some(&false) {
                seen[e] = true;
                out.push((e, rank));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `experts` as a guess ranked in the given order.
    fn ranked(experts: &[usize]) -> Vec<RankedGuess> {
        experts.iter().enumerate().map(|(rank, &e)| (e, rank)).collect()
    }

    #[test]
    fn guesses_are_read_only_while_they_prove_right() {
        let mut b = GuessBook::default();
        assert!(b.open(Some(AUTO_MIN_PRECISION)) && b.precision().is_none());
        // Half right, long enough to leave the warm-up: the gate closes; forced modes still read.
        for _ in 0..40 {
            b.record(3, 1, &ranked(&[1, 2, 5, 7]));
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
            b.record(0, 1, &ranked(&[2, 3]));
            b.score(0, &[2, 3, 8]);
        }
        assert!(b.precision().unwrap() > 0.9 && b.open(Some(AUTO_MIN_PRECISION)));
    }

    #[test]
    fn each_distance_and_rank_is_judged_on_its_own() {
        let min = Some(AUTO_MIN_PRECISION);
        let mut b = GuessBook::default();
        // Next layer: the first two ranks right, the last two wrong (half right overall). Two layers ahead:
        // only the first rank right.
        for step in 0..60 {
            let layer = step % 5;
            b.record(layer, 2, &ranked(&[4, 9, 10, 11]));
            b.record(layer, 1, &ranked(&[4, 5, 6, 7]));
            assert_eq!(
                b.score(layer, &[1, 4, 5]),
                (4, 2),
                "the nearest guess is the one counted"
            );
        }
        assert!((b.precision().unwrap() - 0.5).abs() < 1e-9);
        assert!(!b.open(min), "a prompt's guesses follow the nearest guesses as a whole");
        let wanted = |d, ranks: std::ops::Range<usize>| ranks.map(|r| b.wanted(d, r, min)).collect::<Vec<_>>();
        assert_eq!(wanted(1, 0..4), [true, true, false, false]);
        assert_eq!(wanted(2, 0..4), [true, false, false, false]);
        // Cells never scored (a farther distance, a lower rank) are read until they have a record.
        assert!(b.wanted(3, 0, min) && b.wanted(1, 7, min));
        assert!(b.wanted(1, 3, None), "forced modes read every guess");
        let p = b.precision_by_rank();
        assert_eq!((p.len(), p[0].len(), p[1].len(), p[2].len()), (3, 0, 4, 4));
        assert_eq!(
            (p[1][1], p[1][2], p[2][0], p[2][1]),
            (Some(1.0), Some(0.0), Some(1.0), Some(0.0))
        );
        // A refined guess (distance 0) is judged in its own cells and leaves the overall precision alone.
        for step in 0..60 {
            b.record(step % 5, 0, &ranked(&[4, 5, 1, 8]));
            b.record(step % 5, 1, &ranked(&[4, 5, 6, 7]));
            assert_eq!(b.score(step % 5, &[1, 4, 5]), (4, 2));
        }
        assert!((b.precision().unwrap() - 0.5).abs() < 1e-9);
        let refined: Vec<bool> = (0..4).map(|r| b.wanted(0, r, min)).collect();
        assert_eq!(refined, [true, true, true, false]);
        assert_eq!(b.precision_by_rank()[0][3], Some(0.0));
    }

    #[test]
    fn merged_guesses_keep_each_experts_best_rank() {
        let rows = vec![vec![3, 1, 7], vec![1, 5], vec![], vec![3, 9, 2]];
        let m = merge_ranked(&rows, 10);
        assert_eq!(m, [(3, 0), (1, 0), (5, 1), (9, 1), (7, 2), (2, 2)]);
        // Out-of-range experts (a corrupt route) are dropped, not a panic.
        assert_eq!(merge_ranked(&[vec![12, 0]], 10), [(0, 1)]);
        assert!(merge_ranked(&[], 10).is_empty());
    }
}
