//! Drafting per slot in the batched engine is lossless per request, on every cache kind that
//! batches (full attention, sliding-window rings that wrap, recurrent state): whatever each row
//! drafts (the right continuation, wrong tokens, a right start then wrong ones, nothing; blocks
//! of different widths in one step, so rows drop different numbers of positions), every row's
//! greedy ids equal that prompt's ids decoded alone, and its logprobs stay within 1e-4 of them
//! (f32; a batch's rows are computed in other shapes than a single stream's, so their bits may
//! differ, as they do for batched decoding without drafts). The tapped target outputs each row
//! hands its drafter (DSpark's input) are those of its own positions.

mod common;

use mlx_rs::ops::indexing::IndexOp;
use mlxb::engine::batch::{BatchGenerator, BatchSettings, DecodingRow, SequenceRequest};
use mlxb::engine::forks::Forks;
use mlxb::engine::models::{self, ForwardOpts, LanguageModel};
use mlxb::engine::sample::{Sampler, SamplerConfig};
use std::collections::HashMap;

fn greedy() -> Sampler {
    Sampler::new(&SamplerConfig::default()).unwrap()
}

/// What row `row` drafts at step `step`, having handed out `produced` of the ids `want`: the
/// right continuation, wrong tokens, a right start then a wrong token, or nothing, in turns
/// that differ by row, with a block length that differs by row.
fn draft_for(row: usize, step: usize, produced: usize, want: &[u32], vocab: u32) -> Vec<u32> {
    let k = 1 + (row + step) % 4;
    let right: Vec<u32> = want.iter().skip(produced).take(k).copied().collect();
    let wrong = |t: u32| 3 + (t + 1) % (vocab - 3);
    match (row + step) % 4 {
        0 => right,
        1 => right.iter().map(|&t| wrong(t)).collect(),
        2 => {
            let mut d = right.clone();
            if let Some(last) = d.last_mut() {
                *last = wrong(*last);
            }
            d
        }
        _ => Vec::new(),
    }
}

#[test]
fn drafted_rows_keep_their_solo_greedy_output() {
    drafted_rows_keep_their_solo_greedy_output_on(&common::tiny_llama(serde_json::json!({})));
}

/// Every other layer a sliding window of 8 that the longer rows wrap, so rows roll back by
/// restoring their caches and replaying what they kept.
#[test]
fn drafted_rows_keep_their_solo_greedy_output_past_a_sliding_window() {
    drafted_rows_keep_their_solo_greedy_output_on(&common::tiny_gemma3());
}

/// Sliding and full layers, the last two reading earlier layers' keys and values.
#[test]
fn drafted_rows_keep_their_solo_greedy_output_with_shared_kv_layers() {
    drafted_rows_keep_their_solo_greedy_output_on(&common::tiny_gemma4(serde_json::json!({})));
}

/// Recurrent (gated delta-net) layers between full-attention ones.
#[test]
fn drafted_rows_keep_their_solo_greedy_output_with_recurrent_layers() {
    drafted_rows_keep_their_solo_greedy_output_on(&common::tiny_qwen3_5(serde_json::json!({})));
}

fn drafted_rows_keep_their_solo_greedy_output_on(config: &serde_json::Value) {
    let tmp = tempfile::tempdir().unwrap();
    let vocab = 384;
    common::make_model(tmp.path(), config, "f32", None);
    let mut loaded = models::load(tmp.path(), Forks::default()).unwrap();
    let lengths = [5usize, 9, 14, 3, 20, 7];
    let budgets = [24usize, 30, 17, 28, 26, 1];
    let prompts: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| common::prompt_ids(n, vocab, i as u32 + 1))
        .collect();
    let want: Vec<Vec<(u32, mlx_rs::Array)>> = prompts
        .iter()
        .zip(budgets)
        .map(|(p, n)| common::single_stream(&mut loaded, p, n, 2048))
        .collect();
    let want_ids: Vec<Vec<u32>> = want
        .iter()
        .map(|w| w.iter().map(|(t, _)| *t).collect())
        .collect();

    // Two prompts prefilled at a time: rows join the decoding batch at different steps; long
    // prompts are prefilled in several chunks.
    let settings = BatchSettings {
        prefill_batch_size: 2,
        completion_batch_size: 8,
        prefill_step_size: 8,
    };
    let taps = vec![1usize, 3];
    let mut gen = BatchGenerator::new(
        loaded.model.as_ref(),
        &loaded.plan,
        greedy(),
        vec![],
        settings,
    )
    .unwrap()
    .speculative(loaded.model.as_ref())
    .unwrap()
    .tapping(taps.clone());
    let requests = prompts
        .iter()
        .zip(budgets)
        .map(|(p, n)| SequenceRequest::new(p.clone(), n))
        .collect();
    let uids = gen.insert(requests).unwrap();
    let row_of: HashMap<usize, usize> = uids.iter().enumerate().map(|(i, &u)| (u, i)).collect();
    let mut got: Vec<Vec<(u32, mlx_rs::Array)>> = vec![Vec::new(); prompts.len()];
    let (mut proposed, mut accepted, mut uneven) = (0, 0, 0);
    // Per row, per position: the latest tapped outputs handed to a proposal (a rejected draft's
    // position is handed out again with the token that replaces it).
    let mut tapped: Vec<HashMap<usize, Vec<mlx_rs::Array>>> = vec![HashMap::new(); prompts.len()];
    // Per row: positions before this are final and their latest taps were handed out (every
    // handed-out token but the newest has been forwarded before the proposal sees it).
    let mut settled = vec![0usize; prompts.len()];
    for step in 0.. {
        // A draft continues the tokens handed out so far: a row's pending token first (as read,
        // or guessed while unread), then the variant of the turn.
        let mut propose = |rows: &[DecodingRow], _: &mut dyn LanguageModel| {
            for r in rows {
                let row = row_of[&r.uid];
                settled[row] = settled[row].max(prompts[row].len() + got[row].len() - 1);
                for t in &r.tapped {
                    for j in 0..t.layers[0].shape()[1] {
                        let at: Vec<mlx_rs::Array> =
                            t.layers.iter().map(|l| l.index((0, j, ..))).collect();
                        tapped[row_of[&r.uid]].insert(t.first_position + j as usize, at);
                    }
                }
            }
            Ok(rows
                .iter()
                .map(|r| {
                    let row = row_of[&r.uid];
                    let seen = got[row].len();
                    let d = match r.next {
                        Some(next) => std::iter::once(next)
                            .chain(draft_for(row, step, seen + 1, &want_ids[row], vocab))
                            .collect(),
                        None => draft_for(row, step, seen, &want_ids[row], vocab),
                    };
                    (r.uid, d)
                })
                .collect::<HashMap<usize, Vec<u32>>>())
        };
        let tokens = gen
            .next_tokens_drafted(loaded.model.as_mut(), &mut propose)
            .unwrap();
        if tokens.is_empty() {
            break;
        }
        for t in tokens {
            got[row_of[&t.uid]].push((t.token, t.logprobs));
        }
        let verified = gen.take_verified();
        let kept: Vec<usize> = verified.iter().map(|v| v.accepted).collect();
        if kept.iter().any(|&a| a != kept[0]) {
            uneven += 1;
        }
        proposed += verified.iter().map(|v| v.proposed).sum::<usize>();
        accepted += verified.iter().map(|v| v.accepted).sum::<usize>();
    }
    // The drafts exercised both sides: kept and rejected, rows dropping different amounts.
    assert!(
        accepted > 10 && proposed > accepted + 10,
        "{accepted}/{proposed}"
    );
    assert!(
        uneven > 3,
        "rows kept the same number of drafts in all but {uneven} steps"
    );
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        let ids: Vec<u32> = got.iter().map(|(t, _)| *t).collect();
        assert_eq!(
            ids, want_ids[i],
            "row {i}: ids differ from the prompt alone"
        );
        for (s, ((_, a), (_, b))) in got.iter().zip(want).enumerate() {
            let diff = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap();
            let diff = diff.item_exact::<f32>();
            assert!(diff < 1e-4, "row {i} step {s}: logprobs differ by {diff}");
        }
    }
    for (i, got) in got.iter().enumerate() {
        check_taps(
            &mut loaded,
            &taps,
            &prompts[i],
            got,
            (&tapped[i], settled[i]),
            i,
        );
    }
}

/// Row `row`'s tapped outputs as handed to its proposals (`seen`, by position) against one
/// single-stream forward of its prompt and generated tokens: every position before `settled`
/// within 1e-4 of the largest output (at least 1e-4), none missing (the positions of a row's last steps have no proposal left to go
/// to, and may still hold a rejected draft's outputs).
fn check_taps(
    loaded: &mut models::LoadedModel,
    taps: &[usize],
    prompt: &[u32],
    got: &[(u32, mlx_rs::Array)],
    (seen, settled): (&HashMap<usize, Vec<mlx_rs::Array>>, usize),
    row: usize,
) {
    let ids: Vec<i32> = prompt
        .iter()
        .chain(got.iter().map(|(t, _)| t))
        .map(|&t| t as i32)
        .collect();
    let mut caches = loaded.model.make_caches();
    let opts = ForwardOpts {
        exit_after: None,
        taps: taps.to_vec(),
    };
    let input = mlx_rs::Array::from_slice(&ids, &[1, ids.len() as i32]);
    let out = loaded
        .model
        .forward_ext(&input, &mut caches, &opts)
        .unwrap();
    if got.len() > 2 {
        assert!(
            settled > prompt.len(),
            "row {row}: taps only up to {settled}"
        );
    }
    for p in 0..settled {
        let at = seen
            .get(&p)
            .unwrap_or_else(|| panic!("row {row}: no tapped outputs for position {p}"));
        for (l, (a, solo)) in at.iter().zip(&out.taps).enumerate() {
            let b = solo.index((0, p as i32, ..));
            let diff = a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap();
            let diff = diff.item_exact::<f32>();
            // Relative to the outputs' size: gemma's hidden states run to tens.
            let scale = b.abs().unwrap().max(None).unwrap().item_exact::<f32>();
            assert!(
                diff < 1e-4 * scale.max(1.0),
                "row {row} position {p} tap {l}: off by {diff} (largest {scale})"
            );
        }
    }
}

/// At temperature 1 a drafting batch keeps each request's distribution: batches that mix two
/// prompts, rows that draft (always token 3, two tokens a step: mostly wrong, sometimes right)
/// and rows that do not, give each prompt's second and third tokens the distribution the same
/// batches give without drafts (two-sample chi-square per prompt and position; fixed seeds,
/// deterministic).
#[test]
fn sampled_rows_keep_their_distribution_in_a_drafting_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let config = common::tiny_llama(serde_json::json!({
        "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 12
    }));
    common::make_model_with(tmp.path(), &config, "f32", None, &["--no-tokenizer"]);
    let mut loaded = models::load(tmp.path(), Forks::default()).unwrap();
    let prompts = [vec![1u32, 5, 7, 2, 9], vec![4u32, 4, 10, 6]];
    let (rows, batches, vocab) = (8usize, 200usize, 12usize);
    // counts[drafting][prompt][position - 1][token]
    let mut counts = vec![vec![vec![vec![0f64; vocab]; 2]; 2]; 2];
    let (mut proposed, mut accepted) = (0, 0);
    for drafting in [false, true] {
        mlxb::engine::sample::seed(if drafting { 1234 } else { 99 }).unwrap();
        for _ in 0..batches {
            let sampler = Sampler::new(&SamplerConfig {
                temp: 1.0,
                ..Default::default()
            })
            .unwrap();
            let settings = BatchSettings {
                prefill_batch_size: rows,
                completion_batch_size: rows,
                prefill_step_size: 2048,
            };
            let mut gen = BatchGenerator::new(
                loaded.model.as_ref(),
                &loaded.plan,
                sampler,
                vec![],
                settings,
            )
            .unwrap()
            .speculative(loaded.model.as_ref())
            .unwrap();
            let requests = (0..rows)
                .map(|r| SequenceRequest::new(prompts[r % 2].clone(), 3))
                .collect();
            let uids = gen.insert(requests).unwrap();
            let row_of: HashMap<usize, usize> =
                uids.iter().enumerate().map(|(i, &u)| (u, i)).collect();
            let mut got = vec![Vec::new(); rows];
            let mut propose = |decoding: &[DecodingRow], _: &mut dyn LanguageModel| {
                Ok(decoding
                    .iter()
                    .filter(|r| drafting && row_of[&r.uid] % 4 != 3)
                    .map(|r| {
                        let lead = r.next.into_iter().chain(r.next_pending.then_some(3));
                        (r.uid, lead.take(1).chain([3, 3]).collect())
                    })
                    .collect::<HashMap<usize, Vec<u32>>>())
            };
            loop {
                let tokens = gen
                    .next_tokens_drafted(loaded.model.as_mut(), &mut propose)
                    .unwrap();
                if tokens.is_empty() {
                    break;
                }
                for t in tokens {
                    got[row_of[&t.uid]].push(t.token as usize);
                }
                for v in gen.take_verified() {
                    proposed += v.proposed;
                    accepted += v.accepted;
                }
            }
            for (r, toks) in got.iter().enumerate() {
                assert_eq!(toks.len(), 3, "row {r}: {toks:?}");
                for pos in 1..3 {
                    counts[usize::from(drafting)][r % 2][pos - 1][toks[pos]] += 1.0;
                }
            }
        }
    }
    // Drafts were both kept and rejected.
    assert!(
        accepted > 50 && proposed > accepted + 50,
        "{accepted}/{proposed}"
    );
    for (p, (plain_p, spec_p)) in counts[0].iter().zip(&counts[1]).enumerate() {
        for (pos, (plain, spec)) in plain_p.iter().zip(spec_p).enumerate() {
            let (chi2, dof) = common::two_sample_chi_square(plain, spec);
            // 99.9th percentile of chi-square with up to 11 dof is 31.3.
            assert!(dof >= 3, "prompt {p}: too concentrated to test: {plain:?}");
            assert!(
                chi2 < 31.3,
                "prompt {p} token {}: drafting changed the distribution: chi2 {chi2:.1} over {dof} bins; plain {plain:?} drafting {spec:?}",
                pos + 2
            );
            assert!(
                spec[3] < plain[3] * 1.5 + 30.0,
                "prompt {p}: the drafted token is over-represented: plain {plain:?} drafting {spec:?}"
            );
        }
    }
}
