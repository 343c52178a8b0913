//! The epoch loop that the EAGLE-head and draft-model trainers share: length-grouped
//! batches, the learning-rate schedule, a step line (and a step-log entry) every tenth of an
//! epoch, an epoch summary with the held-out means, the trainer's own record and save after
//! every epoch, and with `keep_best` the best epoch so far ([`BestEpoch`]: what is saved,
//! when to stop early). Each trainer implements [`EpochTrainer`] with what differs: its
//! batch, its step, its metrics, its log entry, its save and the score its best epoch is
//! ranked by.

use crate::common::epoch_batches;
use crate::dataset::FeatureDataset;
use crate::error::Result;
use candle_core::Tensor;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// Means over the loss rows of an epoch or of a held-out evaluation, as the logs show them.
pub(crate) trait EpochMeans {
    /// The name of the top-1 metric in step lines (`agreement`, `top-1`).
    const TOP1: &'static str;
    fn loss(&self) -> f64;
    fn top1(&self) -> f64;
    fn rows(&self) -> usize;
    /// `loss … (…) <top-1 name> …`, as in `epoch N/M: train <this>; val <this>`.
    fn describe(&self) -> String;
}

/// The line of the evaluation before training: `epoch 0 (init: …): val … over N rows`.
pub(crate) fn log_initial(
    init_name: &str,
    val: Option<&impl EpochMeans>,
    log: &mut dyn FnMut(&str),
) {
    if let Some(v) = val {
        log(&format!(
            "epoch 0 (init: {init_name}): val {} over {} rows",
            v.describe(),
            v.rows()
        ));
    }
}

/// How the loop orders and paces training.
pub(crate) struct Schedule {
    pub epochs: usize,
    pub batch_size: usize,
    pub seed: u64,
    /// `true`: each epoch's batch order (and batch randomness) comes from a generator seeded
    /// with the seed and the epoch alone, so that a resumed run sees the batches an
    /// uninterrupted run would have; `false`: one generator seeded once runs through all
    /// epochs.
    pub reseed_each_epoch: bool,
}

/// What an epoch leaves for the trainer's log.
pub(crate) struct EpochEnd<M> {
    pub epoch: usize,
    /// Optimiser steps taken so far.
    pub steps: usize,
    /// The learning rate of the epoch's last step.
    pub lr: f64,
    pub train: M,
    pub val: Option<M>,
    /// The gradient norm of the epoch's last step.
    pub grad_norm: f64,
    pub seconds: f64,
}

/// A trainer as [`run_epochs`] drives it.
pub(crate) trait EpochTrainer {
    type Batch;
    /// Loss sums over the rows of one or more steps.
    type Sums;
    type Means: EpochMeans;
    /// Optimiser steps taken so far.
    fn steps(&self) -> usize;
    /// The learning rate of step `step` (0-based) of `total`.
    fn lr_at(&self, step: usize, total: usize) -> f64;
    /// The batch of sequences `seqs`; `None` when none of them has a loss row.
    fn make_batch(&self, seqs: &[usize], rng: &mut ChaCha8Rng) -> Result<Option<Self::Batch>>;
    /// One optimiser step: the batch's loss sums and the gradient norm.
    fn train_step(&mut self, batch: &Self::Batch, lr: f64) -> Result<(Self::Sums, f64)>;
    /// Sums over no rows.
    fn zero_sums(&self) -> Self::Sums;
    fn add(total: &mut Self::Sums, sums: &Self::Sums);
    fn means(&self, sums: &Self::Sums) -> Self::Means;
    /// The held-out means; `None` without held-out sequences.
    fn validate(&self) -> Result<Option<Self::Means>>;
    /// The training log's step entries: (step, loss, top1).
    fn step_log(&mut self) -> &mut Vec<(usize, f64, f64)>;
    /// Records a finished epoch in the training log and saves, when it saves: returns what
    /// was written, as the log line `saved …` names it.
    fn end_epoch(&mut self, end: EpochEnd<Self::Means>) -> Result<Option<String>>;
    /// After an epoch has ended: `Some(why)` to stop before the planned epochs are done.
    fn stop_early(&self) -> Option<String> {
        None
    }
}

/// Trains epochs `first_epoch..=schedule.epochs` over `train`. `start` is when training
/// began (step lines show the time since). `log` receives one line per event.
pub(crate) fn run_epochs<T: EpochTrainer>(
    trainer: &mut T,
    data: &FeatureDataset,
    train: &[usize],
    schedule: &Schedule,
    first_epoch: usize,
    start: Instant,
    log: &mut dyn FnMut(&str),
) -> Result<()> {
    let steps_per_epoch = train.len().div_ceil(schedule.batch_size);
    let total = steps_per_epoch * schedule.epochs;
    let every = (steps_per_epoch / 10).max(1);
    let mut rng = ChaCha8Rng::seed_from_u64(schedule.seed);
    for epoch in first_epoch..=schedule.epochs {
        let te = Instant::now();
        if schedule.reseed_each_epoch {
            rng = ChaCha8Rng::seed_from_u64(
                schedule.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
        }
        let mut sums = trainer.zero_sums();
        let mut window_sums = trainer.zero_sums();
        let (mut last_norm, mut lr) = (0.0, 0.0);
        for (i, group) in epoch_batches(data, train, schedule.batch_size, &mut rng)
            .iter()
            .enumerate()
        {
            let Some(batch) = trainer.make_batch(group, &mut rng)? else {
                continue;
            };
            lr = trainer.lr_at(trainer.steps(), total);
            let (s, norm) = trainer.train_step(&batch, lr)?;
            last_norm = norm;
            T::add(&mut sums, &s);
            T::add(&mut window_sums, &s);
            if (i + 1) % every == 0 {
                let m = trainer.means(&window_sums);
                let step = trainer.steps();
                trainer.step_log().push((step, m.loss(), m.top1()));
                log(&format!(
                    "epoch {epoch} step {}/{steps_per_epoch} ({step} total): loss {:.4} {} {:.3} lr {lr:.2e} |g| {norm:.3} [{:.0}s]",
                    i + 1,
                    m.loss(),
                    T::Means::TOP1,
                    m.top1(),
                    start.elapsed().as_secs_f64()
                ));
                window_sums = trainer.zero_sums();
            }
        }
        let tm = trainer.means(&sums);
        let vm = trainer.validate()?;
        let mut line = format!("epoch {epoch}/{}: train {}", schedule.epochs, tm.describe());
        if let Some(v) = &vm {
            line.push_str(&format!("; val {}", v.describe()));
        }
        line.push_str(&format!(" [{:.0}s]", te.elapsed().as_secs_f64()));
        log(&line);
        let end = EpochEnd {
            epoch,
            steps: trainer.steps(),
            lr,
            train: tm,
            val: vm,
            grad_norm: last_norm,
            seconds: te.elapsed().as_secs_f64(),
        };
        if let Some(saved) = trainer.end_epoch(end)? {
            log(&format!("saved {saved}"));
        }
        if let Some(why) = trainer.stop_early() {
            log(&why);
            break;
        }
    }
    Ok(())
}

/// With `keep_best` (`Recipe::keep_best`): the epoch with the best held-out score so far, by
/// the score its trainer names, and a copy of its weights, which the trainer saves instead of
/// the last epoch's and ends with.
pub(crate) struct BestEpoch {
    /// The score's name in log lines, e.g. "held-out chain score".
    what: &'static str,
    /// The epoch the run started from (its weights are the first best).
    first: usize,
    /// The last epoch finished.
    last: usize,
    pub epoch: usize,
    score: f64,
    pub tensors: BTreeMap<String, Tensor>,
}

impl BestEpoch {
    /// The starting weights, epoch `epoch` of the log, with their held-out `score`.
    pub fn start(
        what: &'static str,
        epoch: usize,
        score: f64,
        tensors: BTreeMap<String, Tensor>,
    ) -> Self {
        BestEpoch {
            what,
            first: epoch,
            last: epoch,
            epoch,
            score,
            tensors,
        }
    }

    /// Records finished epoch `epoch`: its weights (`snapshot`) become the best when `score`
    /// beats it (ties keep the earlier; a NaN score, from weights that diverged, never wins,
    /// and any number beats a NaN best).
    pub fn offer(
        &mut self,
        epoch: usize,
        score: f64,
        snapshot: impl FnOnce() -> Result<BTreeMap<String, Tensor>>,
    ) -> Result<()> {
        self.last = epoch;
        if score > self.score || (self.score.is_nan() && !score.is_nan()) {
            self.tensors = snapshot()?;
            (self.epoch, self.score) = (epoch, score);
        }
        Ok(())
    }

    /// The log's `saved …` text for the best weights written to `dir`.
    pub fn saved(&self, dir: &Path) -> String {
        format!(
            "{} (epoch {}'s weights, the best {} so far: {:.3})",
            dir.display(),
            self.epoch,
            self.what,
            self.score
        )
    }

    /// Why to stop when `patience` epochs in a row have not beaten the best; `None` to go on.
    pub fn stop(&self, patience: Option<usize>) -> Option<String> {
        let patience = patience?;
        (self.last - self.epoch >= patience).then(|| {
            format!(
                "stopping early: {patience} epoch(s) without a better {} than epoch {}'s",
                self.what, self.epoch
            )
        })
    }

    /// The log's last line: which epoch's weights the run kept.
    pub fn kept(&self) -> String {
        format!(
            "kept epoch {}'s weights: {} {:.3}, the best of epochs {}-{}",
            self.epoch, self.what, self.score, self.first, self.last
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Epoch `e`'s stand-in weights: one tensor holding `e`.
    fn weights(e: usize) -> Result<BTreeMap<String, Tensor>> {
        let t = Tensor::new(&[e as f32], &candle_core::Device::Cpu)?;
        Ok(BTreeMap::from([("w".to_string(), t)]))
    }

    fn kept_weights(best: &BestEpoch) -> f32 {
        best.tensors["w"].to_vec1::<f32>().unwrap()[0]
    }

    #[test]
    fn the_best_epoch_is_the_highest_score_the_earliest_of_a_tie_never_a_nan() {
        let mut best = BestEpoch::start("score", 0, f64::NAN, weights(0).unwrap());
        best.offer(1, 0.3, || weights(1)).unwrap();
        assert_eq!((best.epoch, kept_weights(&best)), (1, 1.0));
        best.offer(2, f64::NAN, || weights(2)).unwrap();
        best.offer(3, 0.3, || weights(3)).unwrap();
        assert_eq!((best.epoch, kept_weights(&best)), (1, 1.0));
        assert_eq!(best.stop(Some(3)), None);
        assert_eq!(
            best.stop(Some(2)).as_deref(),
            Some("stopping early: 2 epoch(s) without a better score than epoch 1's")
        );
        assert_eq!(best.stop(None), None);
        best.offer(4, 0.5, || weights(4)).unwrap();
        assert_eq!(
            best.kept(),
            "kept epoch 4's weights: score 0.500, the best of epochs 0-4"
        );
    }
}
