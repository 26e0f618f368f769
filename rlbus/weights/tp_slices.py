"""Which parts of the published weights a tensor-parallel vLLM rank holds, and so which chunks it fetches.

A rollout worker whose vLLM engine runs with tensor parallelism ``tp`` holds on each TP rank only a slice of
most parameters, some of them fused. Published versions name full tensors in checkpoint (Hugging Face)
names (`rlbus.weights.publish`), so a TP rank needs, for each vLLM parameter it holds, a few boxes of a few
published tensors. `tp_slices` computes them for the Llama/Qwen/Mistral layout vLLM loads:

* ``qkv_proj`` (QKVParallelLinear, column-parallel): rank r's local rows are its q heads, then its k heads,
  then its v heads: rows [r·nq/tp·d, (r+1)·nq/tp·d) of ``q_proj`` and the rows of its kv heads of ``k_proj``
  and ``v_proj`` (biases alike). **GQA with fewer kv heads than ranks**: vLLM cannot split a kv head, so it
  gives every rank one whole kv head and replicates each over tp / n_kv consecutive ranks (rank r holds kv
  head r // (tp / n_kv)), as `QKVParallelLinear` does (``num_kv_head_replicas``). Those ranks fetch the same
  k/v rows; the union over ranks is still each kv head once. With n_kv ≥ tp each rank holds n_kv / tp kv
  heads. vLLM requires tp to divide the query heads, and n_kv and tp to divide one another; so does this.
* ``gate_up_proj`` (MergedColumnParallelLinear): rows [r·I/tp, (r+1)·I/tp) of ``gate_proj``, then of ``up_proj``.
* ``o_proj``, ``down_proj`` (RowParallelLinear): every row, columns [r·K/tp, (r+1)·K/tp) of the input dim.
* ``embed_tokens``, ``lm_head`` (vocab-parallel): the vocabulary padded to a multiple of 64, cut in tp
  equal runs of rows; a rank's rows past the real vocabulary are padding (zero, never fetched). A tied
  ``lm_head`` (no ``lm_head.weight`` published) reads ``embed_tokens``.
* everything else (the norms): replicated, the whole tensor on every rank.

Fetching. A `Slice` is a box of rows × columns of a published tensor viewed as 2-D (dim 0 × the rest);
`Slice.element_ranges` gives the flat element ranges it covers (one range for a run of whole rows, one per
row for a column block) and `needed_chunks` the manifest's chunks that touch them (each `ChunkRef` lists
the flat spans it holds). The chunk, not a byte range of it, is what a worker fetches: a chunk is
compressed and verified as a whole (its xxh3-128 in the manifest), and a delta record decodes against the
old values of all it covers, so a TP worker keeps the chunk-aligned cover of its slices, not just the
slices. Column-parallel and vocab-parallel tensors are runs of rows, so a rank fetches about 1/tp of them
(plus at most a chunk at each end); a row-parallel tensor's column block touches every row, so it is
fetched whole — until records are cut in column-block order for those tensors (a tensor-table flag in the
codec, not done). The blob store's range reads (`BlobStore.get_range`) serve a raw layout; they are not
what a compressed chunk needs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlbus.schemas import ChunkRef

#: vLLM pads the vocabulary of its vocab-parallel embedding and LM head to a multiple of this
#: (``DEFAULT_VOCAB_PADDING_SIZE``), then cuts the padded rows in tp equal runs.
VOCAB_PADDING = 64

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")
_PART = re.compile(
    r"^(?P<head>.*\.)(?P<part>q_proj|k_proj|v_proj|gate_proj|up_proj|o_proj|down_proj)\.(?P<kind>weight|bias)$"
)


@dataclass(frozen=True)
class TPLayout:
    """What the mapping needs of a model's config: head counts and sizes, the vocabulary."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> TPLayout:
        """From a Hugging Face config: a ``config.json`` mapping or a ``PretrainedConfig``."""
        def get(key: str) -> Any:
            return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

        heads = int(get("num_attention_heads"))
        head_dim = get("head_dim") or int(get("hidden_size")) // heads
        return cls(num_heads=heads, num_kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(head_dim),
                   vocab=int(get("vocab_size")))

    def check(self, tp: int) -> None:
        """ValueError where vLLM would refuse this tensor-parallel size."""
        if tp < 1 or self.num_heads % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide the {self.num_heads} attention heads")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"tensor parallel size {tp} and the {self.num_kv_heads} kv heads do not divide each other")

    def kv_heads(self, tp: int, rank: int) -> tuple[int, int]:
        """The kv heads [first, stop) rank ``rank`` holds (one replicated head when n_kv < tp)."""
        if self.num_kv_heads >= tp:
            per = self.num_kv_heads // tp
            return rank * per, (rank + 1) * per
        head = rank // (tp // self.num_kv_heads)
        return head, head + 1

    def vocab_rows(self, tp: int, rank: int) -> tuple[int, int, int]:
        """(first, stop) rows of the real vocabulary rank ``rank`` holds, and its local (padded) row count."""
        padded = -(-self.vocab // VOCAB_PADDING) * VOCAB_PADDING
        per = -(-padded // tp)
        return min(rank * per, self.vocab), min((rank + 1) * per, self.vocab), per


@dataclass(frozen=True)
class Slice:
    """Rows [rows) × columns [cols) of the published tensor ``source`` (2-D view: dim 0 × the rest; ``cols``
    None: whole rows), landing at local rows [at, at + rows) of the vLLM parameter on this rank."""

    source: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    at: int
    #: The source's shape, whose row length turns boxes into flat element ranges.
    shape: tuple[int, ...]

    @property
    def row_length(self) -> int:
        n = 1
        for s in self.shape[1:]:
            n *= s
        return n

    def element_ranges(self) -> list[tuple[int, int]]:
        """The flat [start, stop) element ranges of the published tensor this slice covers, in order."""
        a, b = self.rows
        width = self.row_length
        if self.cols is None or self.cols == (0, width):
            return [(a * width, b * width)] if b > a else []
        c, d = self.cols
        return [(r * width + c, r * width + d) for r in range(a, b)] if d > c else []

    def byte_ranges(self, element_size: int) -> list[tuple[int, int]]:
        """`element_ranges` in bytes of the decoded tensor (its raw layout, C order)."""
        return [(s * element_size, e * element_size) for s, e in self.element_ranges()]


def tp_slices(shapes: Mapping[str, Sequence[int]], layout: TPLayout, tp: int, rank: int) -> dict[str, list[Slice]]:
    """For each vLLM parameter on TP rank ``rank`` of ``tp``: the slices of published tensors (``shapes``:
    checkpoint name → full shape) it is made of, in local-row order. See the module docstring."""
    layout.check(tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {tp}")
    out: dict[str, list[Slice]] = {}
    fused: dict[str, list[tuple[int, Slice]]] = {}
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        m = _PART.match(name)
        if m is not None and m["part"] in _FUSED:
            target, index = _FUSED[m["part"]]
            fused.setdefault(f"{m['head']}{target}.{m['kind']}", []).append(
                (index, _fused_slice(name, shape, m["part"], layout, tp, rank)))
        elif m is not None and m["part"] in _ROW_PARALLEL and m["kind"] == "weight" and len(shape) == 2:
            per = _divide(shape[1], tp, name)
            out[name] = [Slice(name, (0, shape[0]), (rank * per, (rank + 1) * per), 0, shape)]
        elif any(f"{v}." in name for v in _VOCAB) and len(shape) == 2:
            first, stop, _ = layout.vocab_rows(tp, rank)
            out[name] = [Slice(name, (first, stop), None, 0, shape)]
        else:  # norms, a row-parallel bias (added once, on every rank): replicated
            out[name] = [Slice(name, (0, shape[0] if shape else 1), None, 0, shape)]
    for target, members in fused.items():  # stacked in shard order (q, k, v; gate, up)
        at, stacked = 0, []
        for _, s in sorted(members, key=lambda m: m[0]):
            stacked.append(Slice(s.source, s.rows, s.cols, at, s.shape))
            at += s.rows[1] - s.rows[0]
        out[target] = stacked
    tied = "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes
    if tied:  # vLLM ties the LM head to the embedding: the same rows
        out["lm_head.weight"] = list(out["model.embed_tokens.weight"])
    return out


def _fused_slice(name: str, shape: tuple[int, ...], part: str, layout: TPLayout, tp: int, rank: int) -> Slice:
    """A q/k/v or gate/up member's rows on ``rank`` (its local position is set once all members are known)."""
    if part == "q_proj":
        per = layout.num_heads // tp * layout.head_dim
        rows = (rank * per, (rank + 1) * per)
    elif part in ("k_proj", "v_proj"):
        first, stop = layout.kv_heads(tp, rank)
        rows = (first * layout.head_dim, stop * layout.head_dim)
    else:  # gate_proj, up_proj
        per = _divide(shape[0], tp, name)
        rows = (rank * per, (rank + 1) * per)
    return Slice(name, rows, None, 0, shape)


def _divide(size: int, tp: int, name: str) -> int:
    """``size`` / ``tp``; ValueError where vLLM's parallel linear layers would refuse to split ``name``."""
    if size % tp:
        raise ValueError(f"tensor parallel size {tp} does not divide the {size} features of {name}")
    return size // tp


def element_needs(slices: Mapping[str, Iterable[Slice]]) -> dict[str, list[tuple[int, int]]]:
    """Published tensor → the flat element ranges a rank needs of it (merged, sorted)."""
    needs: dict[str, list[tuple[int, int]]] = {}
    for group in slices.values():
        for s in group:
            needs.setdefault(s.source, []).extend(s.element_ranges())
    merged: dict[str, list[tuple[int, int]]] = {}
    for source, ranges in needs.items():
        out: list[tuple[int, int]] = []
        for a, b in sorted(ranges):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        merged[source] = out
    return merged


def needed_chunks(chunks: Sequence[ChunkRef], needs: Mapping[str, Sequence[tuple[int, int]]]) -> list[ChunkRef]:
    """The chunks of a manifest that hold any element a rank needs (``needs``: `element_needs`)."""

    def touches(name: str, start: int, stop: int) -> bool:
        return any(a < stop and start < b for a, b in needs.get(name, ()))

    return [c for c in chunks if any(touches(t.name, t.start, t.stop) for t in c.tensors)]
