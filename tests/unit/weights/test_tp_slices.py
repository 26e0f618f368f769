"""The tensor-parallel slice mapping, checked by construction: each TP rank's vLLM parameters built from
its slices of the published (Hugging Face-named) tensors reassemble vLLM's full fused tensors exactly — q/k/v
stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, row-parallel tensors by columns, the vocabulary
padded to 64 and cut in runs — with GQA's kv heads replicated where there are fewer than ranks; and a rank
that fetches only the chunks its slices touch gets exactly its slices."""

from __future__ import annotations

import pytest
import torch

from rlbus.weights.codec import apply_chunk_, encode_state_keyframe
from rlbus.weights.publish import chunk_refs
from rlbus.weights.tp_slices import Slice, TPLayout, element_needs, needed_chunks, tp_slices

#: SmolLM2-135M-Instruct's config.json (the shipped model, `rlbus.models.sources`): 9 query heads, 3 kv
#: heads of 64, hidden 576, MLP 1536, vocabulary 49,152, tied embeddings, 30 layers.
SMOLLM2_135M = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "intermediate_size": 1536, "vocab_size": 49152, "num_hidden_layers": 30, "tie_word_embeddings": True}
#: The same architecture scaled down so tp 1/2/4 divide the heads (8 query, 2 kv: GQA replication at tp 4),
#: with a vocabulary that is not a multiple of 64 (padding rows).
SMALL = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
         "intermediate_size": 96, "vocab_size": 100, "num_hidden_layers": 2, "tie_word_embeddings": True}


def shapes(config: dict[str, int], layers: int | None = None) -> dict[str, tuple[int, ...]]:
    """The published (checkpoint-named) weights of a Llama-architecture model with a tied LM head."""
    h, d, i, v = config["hidden_size"], config["head_dim"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(config["num_hidden_layers"] if layers is None else layers):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    return out


def published(config: dict[str, int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes(config).items()}


def box(state: dict[str, torch.Tensor], s: Slice) -> torch.Tensor:
    t = state[s.source].reshape(s.shape[0] if s.shape else 1, -1)[s.rows[0]: s.rows[1]]
    return t if s.cols is None else t[:, s.cols[0]: s.cols[1]]


def local(state: dict[str, torch.Tensor], slices: list[Slice], rows: int | None = None) -> torch.Tensor:
    """A vLLM parameter on one rank: its slices stacked at their local rows (``rows``: padded length)."""
    parts = [box(state, s) for s in slices]
    assert [s.at for s in slices] == [sum(len(p) for p in parts[:k]) for k in range(len(parts))]
    out = torch.cat(parts)
    if rows is not None and len(out) < rows:
        out = torch.cat([out, out.new_zeros(rows - len(out), *out.shape[1:])])
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_ranks_slices_reassemble_vllms_full_fused_tensors(tp: int) -> None:
    state = published(SMALL)
    layout = TPLayout.from_config(SMALL)
    ranks = [tp_slices({n: t.shape for n, t in state.items()}, layout, tp, r) for r in range(tp)]
    names = set(ranks[0])
    assert all(set(r) == names for r in ranks)
    p = "model.layers.1."
    qkv, gate_up = p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight"
    assert {qkv, gate_up, "lm_head.weight"} <= names and p + "self_attn.q_proj.weight" not in names

    q_per, kv_per = 8 // tp * 8, max(1, 2 // tp) * 8
    locals_ = [local(state, r[qkv]) for r in ranks]
    assert all(t.shape == (q_per + 2 * kv_per, 64) for t in locals_)
    q = torch.cat([t[:q_per] for t in locals_])
    k_heads = [t[q_per: q_per + kv_per] for t in locals_]
    v_heads = [t[q_per + kv_per:] for t in locals_]
    replicas = max(1, tp // 2)  # tp 4 with 2 kv heads: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    for r in range(tp):
        assert torch.equal(k_heads[r], k_heads[r - r % replicas]) and torch.equal(v_heads[r], v_heads[r - r % replicas])
    k, v = torch.cat(k_heads[::replicas]), torch.cat(v_heads[::replicas])
    fused = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])  # vLLM's full qkv_proj
    assert torch.equal(torch.cat([q, k, v]), fused)

    per = 96 // tp
    gu = [local(state, r[gate_up]) for r in ranks]
    gate, up = torch.cat([t[:per] for t in gu]), torch.cat([t[per:] for t in gu])
    want = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])  # vLLM's gate_up_proj
    assert torch.equal(torch.cat([gate, up]), want)

    for row_parallel in (p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"):
        assert torch.equal(torch.cat([local(state, r[row_parallel]) for r in ranks], dim=1), state[row_parallel])

    padded = 128 // tp  # 100 rows padded to 128
    for vocab in ("model.embed_tokens.weight", "lm_head.weight"):  # the tied head reads the embedding
        parts = [local(state, r[vocab], rows=padded) for r in ranks]
        assert all(len(t) == padded for t in parts)
        whole = torch.cat(parts)
        assert torch.equal(whole[:100], state["model.embed_tokens.weight"]) and not whole[100:].any()

    for norm in ("model.norm.weight", p + "input_layernorm.weight"):
        assert all(torch.equal(local(state, r[norm]).reshape(-1), state[norm]) for r in ranks)

    for r in ranks:  # the flat element ranges are the boxes
        for slices in r.values():
            for s in slices:
                flat = state[s.source].reshape(-1)
                got = torch.cat([flat[a:b] for a, b in s.element_ranges()]) if s.element_ranges() else flat[:0]
                assert torch.equal(got, box(state, s).reshape(-1))
                assert s.byte_ranges(2) == [(a * 2, b * 2) for a, b in s.element_ranges()]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_fetching_only_the_chunks_its_slices_touch_gets_its_slices(tp: int) -> None:
    state = published(SMALL)
    chunks = encode_state_keyframe(state, chunk_bytes=2048)
    refs = chunk_refs("policy", 1, "keyframe", chunks)
    total = sum(c.size for c in chunks)
    layout = TPLayout.from_config(SMALL)
    for rank in range(tp):
        slices = tp_slices({n: t.shape for n, t in state.items()}, layout, tp, rank)
        wanted = needed_chunks(refs, element_needs(slices))
        held = {n: torch.zeros_like(t) for n, t in state.items()}
        for ref in wanted:
            apply_chunk_(held, chunks[refs.index(ref)].data, expected_hash=ref.hash)
        for group in slices.values():
            for s in group:
                assert torch.equal(box(held, s), box(state, s)), s
        assert sum(c.size for c in wanted) < total  # row-parallel tensors whole, the rest about 1/tp


def test_smollm2_135m_on_the_tensor_parallel_sizes_vllm_accepts() -> None:
    """9 query heads, 3 kv heads, MLP 1536: vLLM runs it on tp 1 or 3 only (2 and 4 split no 9 heads, 9
    splits no 1536 features), so its GQA replication case is the small config's tp 4 above."""
    layout = TPLayout.from_config(SMOLLM2_135M)
    assert layout == TPLayout(num_heads=9, num_kv_heads=3, head_dim=64, vocab=49152)
    layer = shapes(SMOLLM2_135M, layers=1)
    for tp in (2, 4):
        with pytest.raises(ValueError, match="does not divide the 9 attention heads"):
            tp_slices(layer, layout, tp, 0)
    with pytest.raises(ValueError, match="does not divide the 1536 features"):
        tp_slices(layer, layout, 9, 0)
    assert [layout.kv_heads(9, r) for r in range(9)] == [(h // 3, h // 3 + 1) for h in range(9)]  # replicated 3×
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    for tp in (1, 3):
        ranks = [tp_slices(layer, layout, tp, r) for r in range(tp)]
        assert [r[qkv][0].rows for r in ranks] == [(k * 576 // tp, (k + 1) * 576 // tp) for k in range(tp)]
        assert [r[qkv][1].rows for r in ranks] == [(k * 192 // tp, (k + 1) * 192 // tp) for k in range(tp)]
        assert [r[qkv][2].at for r in ranks] == [576 // tp + 192 // tp] * tp
        vocab = [r["model.embed_tokens.weight"][0].rows for r in ranks]
        assert vocab == [(k * 49152 // tp, (k + 1) * 49152 // tp) for k in range(tp)]  # 49152 = 768 × 64: no padding
        assert all(r["lm_head.weight"] == r["model.embed_tokens.weight"] for r in ranks)
        down = [r["model.layers.0.mlp.down_proj.weight"][0].cols for r in ranks]
        assert down == [(k * 1536 // tp, (k + 1) * 1536 // tp) for k in range(tp)]


def test_a_size_that_does_not_divide_the_kv_heads_is_refused() -> None:
    layout = TPLayout(num_heads=12, num_kv_heads=4, head_dim=8, vocab=64)
    with pytest.raises(ValueError, match="do not divide each other"):
        layout.check(6)
