//! Training options and the optimizer: the warm-up + cosine learning-rate schedule, the seeded
//! order of examples per step, and AdamW with global-norm clipping.

use crate::engine::error::Result;
use mlx_rs::{ops, Array};

use super::example::SplitMix;
use super::forward::Params;
use super::loss::LossWeights;

/// Training options (what `mlxb train-dspark` decides).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct TrainOptions {
    /// Total optimizer steps.
    pub steps: u64,
    /// Sequences per step.
    pub batch: usize,
    /// Anchors sampled per sequence.
    pub anchors: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Warm-up fraction of the steps.
    pub warmup: f64,
    /// Global gradient-norm clip.
    pub clip: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Seed of the sequence order and anchors.
    pub seed: u64,
    /// Write a checkpoint every this many steps (and at the end).
    pub checkpoint_every: u64,
    /// Weights of the loss terms (states saved before this option existed used DeepSpec's).
    #[serde(default)]
    pub loss_weights: LossWeights,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            steps: 100,
            batch: 4,
            anchors: 32,
            lr: 6e-4,
            warmup: 0.04,
            clip: 1.0,
            weight_decay: 0.0,
            seed: 42,
            checkpoint_every: 50,
            loss_weights: LossWeights::default(),
        }
    }
}

impl TrainOptions {
    /// The learning rate of (0-based) step `t`: linear warm-up over `ceil(warmup * steps)`
    /// steps, then cosine decay to 0.
    pub fn lr_at(&self, t: u64) -> f64 {
        let warm = (self.warmup * self.steps as f64).ceil() as u64;
        if t < warm {
            return self.lr * (t + 1) as f64 / warm as f64;
        }
        let span = (self.steps - warm).max(1) as f64;
        let frac = ((t - warm) as f64 / span).min(1.0);
        self.lr * 0.5 * (1.0 + (std::f64::consts::PI * frac).cos())
    }

    /// The example indices of step `t` over `n` examples: epoch-wise shuffles from the seed.
    pub fn step_examples(&self, t: u64, n: usize) -> Vec<usize> {
        (0..self.batch as u64)
            .map(|j| {
                let global = t * self.batch as u64 + j;
                let (epoch, pos) = (global / n as u64, (global % n as u64) as usize);
                let mut order: Vec<usize> = (0..n).collect();
                SplitMix::new(self.seed, 0x5eed_0000 + epoch).shuffle(&mut order);
                order[pos]
            })
            .collect()
    }
}

/// AdamW state (β = 0.9, 0.999, ε = 1e-8, as torch's defaults DeepSpec uses).
pub struct AdamW {
    /// Steps taken.
    pub step: u64,
    /// First moments.
    pub m: Vec<Array>,
    /// Second moments.
    pub v: Vec<Array>,
}

impl AdamW {
    /// Zero moments for `params`.
    pub fn new(params: &Params) -> Result<Self> {
        let zeros = || -> Result<Vec<Array>> {
            params
                .values
                .iter()
                .map(|p| Ok(ops::zeros_like(p)?))
                .collect()
        };
        Ok(Self {
            step: 0,
            m: zeros()?,
            v: zeros()?,
        })
    }

    /// One update with `grads` clipped to global norm `opts.clip`; returns the pre-clip norm.
    pub fn update(
        &mut self,
        params: &mut Params,
        grads: &[Array],
        opts: &TrainOptions,
    ) -> Result<f32> {
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        let lr = opts.lr_at(self.step) as f32;
        let mut sq = Array::from_f32(0.0);
        for g in grads {
            sq = sq.add(&g.square()?.sum(false)?)?;
        }
        let norm = sq.sqrt()?;
        norm.eval()?;
        let norm_v = norm.item_cast::<f32>();
        let coef = if norm_v.is_finite() && norm_v > opts.clip as f32 {
            opts.clip as f32 / (norm_v + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let s = Array::from_f32;
        let slots = params
            .values
            .iter_mut()
            .zip(self.m.iter_mut())
            .zip(self.v.iter_mut());
        for (g, ((p, m), v)) in grads.iter().zip(slots) {
            let g = g.multiply(s(coef))?;
            let m_new = m.multiply(s(b1))?.add(&g.multiply(s(1.0 - b1))?)?;
            let v_new = v
                .multiply(s(b2))?
                .add(&g.square()?.multiply(s(1.0 - b2))?)?;
            let decayed = p.multiply(s(1.0 - lr * opts.weight_decay as f32))?;
            let upd = m_new
                .divide(s(c1))?
                .divide(&v_new.divide(s(c2))?.sqrt()?.add(s(eps))?)?;
            *p = decayed.subtract(&upd.multiply(s(lr))?)?;
            *m = m_new;
            *v = v_new;
        }
        let all: Vec<&Array> = params.values.iter().chain(&self.m).chain(&self.v).collect();
        mlx_rs::transforms::eval(all)?;
        Ok(norm_v)
    }
}
