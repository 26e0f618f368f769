"""The SPARSE coder for records that live on an accelerator: a batch of records in a few launches.

A batch is every record of a version (or as many as fit a memory budget) of one float dtype, laid end to
end in one flat buffer. The O(n) passes are Triton kernels over all of it at once (:mod:`._triton`: which
elements changed, the position classes' sizes, each change's rank within its class, the decoder's select);
everything per changed element — exponent and value classes, the Bernoulli sequences and their gaps, the
Rice streams and signs, and on decode their inverse — is batched tensor work over the m changes of all
records, with record and sequence ids as keys instead of loops. The host sees per-record statistics
(exponent histograms, for the class choices the CPU makes with the same numpy code), sequence headers, and
the coded bytes; its share is a few dozen numbers a record plus the payload.

The bytes are those of the CPU coder (:mod:`.sparse`, :mod:`._kernels`) to the bit: the tests code the same
records both ways — the Triton kernels under ``TRITON_INTERPRET=1`` on CPU tensors — and compare. Decoding
checks what the CPU decoder checks (the header through the same compiled parsers; stream lengths, symbol
counts, ranges and populations as tensor reductions, one host sync per batch) and raises
:class:`~rlbus.errors.ChunkCorrupt` before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import rlbus.weights.codec._bits as _b
import rlbus.weights.codec._kernels as _k
from rlbus.errors import ChunkCorrupt
from rlbus.weights.bitview import int_flat
from rlbus.weights.codec._bits import check
from rlbus.weights.codec.classes import _class_lut, choose_thresholds, choose_value_thresholds, tail_kmax
from rlbus.weights.codec.format import LEVELS, MAX_CLASSES, _Float
from rlbus.weights.codec.sparse import rice_candidates, sample_stride, sequence_params, write_payload

#: Code CPU tensors here too (Triton's interpreter runs the kernels): how the tests compare this coder with the
#: CPU one on the same records.
ON_CPU = False
_NO_BOUND = 1 << 40  # a threshold no magnitude reaches (unused class slots)
_CHOICE_SLICE = 32  # records per class-choice task on the host's threads
_I64 = torch.int64


def wanted(t: torch.Tensor) -> bool:
    """Whether records of ``t`` are coded here: tensors on an accelerator (and all, with ``ON_CPU``)."""
    return t.device.type != "cpu" or ON_CPU


def _triton() -> Any:
    """The kernels' module, imported on first use: only device batches need Triton."""
    from rlbus.weights.codec import _triton as tr

    return tr


def _bytes_to_bits(data: torch.Tensor) -> torch.Tensor:
    """[8·len] uint8 bits of a uint8 tensor, LSB first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    return ((data[:, None] >> shifts) & 1).reshape(-1)


def _bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_bytes_to_bits` (length a multiple of 8)."""
    weights = (1 << torch.arange(8, dtype=_I64, device=bits.device))
    return (bits.reshape(-1, 8).to(_I64) * weights).sum(1).to(torch.uint8)


def _excl(x: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum (int64)."""
    x = x.to(_I64)
    return torch.cumsum(x, 0) - x


def _seg_excl(x: torch.Tensor, seg: torch.Tensor, nseg: int) -> torch.Tensor:
    """Exclusive prefix sum of ``x`` within runs of equal, non-decreasing ``seg``."""
    incl = torch.cumsum(x.to(_I64), 0)
    excl = incl - x.to(_I64)
    first = torch.zeros(nseg, dtype=_I64, device=x.device)
    counts = torch.bincount(seg, minlength=nseg)
    starts = _excl(counts)
    nonempty = counts > 0
    first[nonempty] = excl[starts[nonempty]]
    return excl - first[seg]


def _local_index(seg: torch.Tensor, nseg: int) -> torch.Tensor:
    """Index of each element within its run of equal, non-decreasing ``seg``."""
    return _seg_excl(torch.ones_like(seg), seg, nseg)


def _ord(b: torch.Tensor, fmt: _Float) -> torch.Tensor:
    """Unsigned bit patterns (int64) → the monotone integer of :func:`rlbus.weights.codec._kernels._ord`."""
    sign = (b >> (fmt.bits - 1)) & 1
    return torch.where(sign == 1, -(b & fmt.mag_mask) - 1, b)


def _unsigned(x: torch.Tensor, fmt: _Float) -> torch.Tensor:
    return x.to(_I64) & ((1 << fmt.bits) - 1)


def _bounds(thresholds: Sequence[Sequence[int]], fmt: _Float, device: torch.device) -> torch.Tensor:
    """[records, 7] thresholds shifted to compare with magnitude bits; unused slots never reached."""
    table = np.full((len(thresholds), MAX_CLASSES - 1), _NO_BOUND, dtype=np.int64)
    for r, thr in enumerate(thresholds):
        table[r, : len(thr)] = np.asarray(thr, dtype=np.int64) << fmt.mant
    return torch.from_numpy(table).to(device)


def _luts(thresholds: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.stack([_class_lut(list(t)) for t in thresholds])).to(device)


@dataclass
class _Batch:
    """Records laid end to end: flat integer buffer(s), record starts and sizes, blocks."""

    starts: list[int]
    sizes: list[int]
    blocks: Any  # _triton.Blocks

    @staticmethod
    def of(tensors: Sequence[torch.Tensor]) -> tuple[_Batch, torch.Tensor]:
        sizes = [t.numel() for t in tensors]
        starts = np.concatenate([[0], np.cumsum(sizes)])[:-1].tolist()
        flat = torch.cat([int_flat(t) for t in tensors]) if len(tensors) > 1 else int_flat(tensors[0])
        return _Batch(starts, sizes, _triton().Blocks.of(starts, sizes, flat.device)), flat

    def record_of(self, pos: torch.Tensor) -> torch.Tensor:
        starts = torch.tensor(self.starts, dtype=_I64, device=pos.device)
        return torch.bucketize(pos, starts[1:], right=True)


# ------------------------------------------------------------------------------------------ encode


def encode_records(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], fmt: _Float) -> list[bytes | None]:
    """SPARSE payloads of records (pairs of same-size tensors of ``fmt``'s dtype on one device), as the CPU
    coder writes them; None for a record with no change."""
    tr = _triton()
    batch, old = _Batch.of(olds)
    new = torch.cat([int_flat(t) for t in news]) if len(news) > 1 else int_flat(news[0])
    dev = old.device
    nrec = len(olds)
    e_count = fmt.exp_count
    pos, old_c, new_c, slots = tr.changes(old, new, batch.blocks)
    m = int(pos.numel())
    out: list[bytes | None] = [None] * nrec
    if m == 0:
        return out
    rec = batch.record_of(pos)
    ou, nu = _unsigned(old_c, fmt), _unsigned(new_c, fmt)
    exps = (ou & fmt.mag_mask) >> fmt.mant
    d = _ord(nu, fmt) - _ord(ou, fmt)
    mag = d.abs()

    # Per-record statistics for the class choices (the CPU's numpy code on the same numbers).
    key = rec * e_count + exps
    hist = torch.bincount(key, minlength=nrec * e_count).reshape(nrec, e_count)
    above = torch.stack([torch.bincount(key[mag > lv + 1], minlength=nrec * e_count) for lv in range(LEVELS)])
    tail_mask = mag > LEVELS
    tmax = torch.full((nrec,), -1, dtype=_I64, device=dev)
    tmax.scatter_reduce_(0, rec[tail_mask], mag[tail_mask] - LEVELS - 1, reduce="amax")
    idx = torch.cat([torch.arange(s, s + n, sample_stride(n), device=dev) for s, n in zip(batch.starts, batch.sizes,
                                                                                           strict=True)])
    srec = batch.record_of(idx)
    sexp = (_unsigned(old[idx], fmt) & fmt.mag_mask) >> fmt.mant
    stride = torch.tensor([sample_stride(n) for n in batch.sizes], dtype=_I64, device=dev)
    sampled = torch.bincount(srec * 256 + sexp, minlength=nrec * 256).reshape(nrec, 256) * stride[:, None]
    tmax_h = tmax.cpu().numpy()
    kmax = max(tail_kmax(int(tmax_h.max())), 0)  # the largest any record tries
    tvals = mag[tail_mask] - LEVELS - 1
    tkey = key[tail_mask]
    tsums = torch.stack([torch.zeros(nrec * e_count, dtype=_I64, device=dev).index_add_(0, tkey, tvals >> k)
                         for k in range(kmax + 1)]).reshape(kmax + 1, nrec, e_count)
    hist_h, above_h = hist.cpu().numpy(), above.reshape(LEVELS, nrec, e_count).cpu().numpy()
    sampled_h, tsums_h = sampled.cpu().numpy(), tsums.cpu().numpy()
    thresholds, vthresholds = _choose_classes(sampled_h[:, :e_count], hist_h, above_h, tmax_h, tsums_h)
    ks_class = [len(t) + 1 for t in thresholds]
    vs_class = [len(t) + 1 for t in vthresholds]

    # Ranks within the position classes.
    bounds = _bounds(thresholds, fmt, dev)
    cnts = tr.class_counts(old, batch.blocks, bounds, fmt.mag_mask)
    bases = tr.class_bases(cnts, batch.blocks)
    class_size = torch.zeros((nrec, 8), dtype=_I64, device=dev).index_add_(0, batch.blocks.record, cnts.to(_I64))
    rank, cls = tr.class_ranks(old, new, batch.blocks, bounds, fmt.mag_mask, bases, slots, m)
    cls = cls.to(_I64)
    order = torch.sort(rec * 8 + cls, stable=True).indices  # class-major within each record
    cm_rec, cm_cls, cm_rank = rec[order], cls[order], rank[order]
    cm_exp, cm_mag, cm_neg = exps[order], mag[order], d[order] < 0

    # Sequence ids: per record K position classes, then level l of value class v at K + (l-1)·V + v.
    kc = torch.tensor(ks_class, dtype=_I64, device=dev)
    vc = torch.tensor(vs_class, dtype=_I64, device=dev)
    nseq = kc + LEVELS * vc
    seq_base = _excl(nseq)
    total_seq = int(nseq.sum())
    lengths = torch.zeros(total_seq, dtype=_I64, device=dev)
    ones = torch.zeros(total_seq, dtype=_I64, device=dev)
    pos_seq_r = torch.repeat_interleave(torch.arange(nrec, device=dev), kc)
    pos_seq_c = torch.arange(int(kc.sum()), device=dev) - torch.repeat_interleave(_excl(kc), kc)
    pos_seq = seq_base[pos_seq_r] + pos_seq_c
    lengths[pos_seq] = class_size[pos_seq_r, pos_seq_c]
    per_class = torch.bincount(cm_rec * 8 + cm_cls, minlength=nrec * 8).reshape(nrec, 8)
    ones[pos_seq] = per_class[pos_seq_r, pos_seq_c]

    coded_seq, coded_local = [], []
    cseq = seq_base[cm_rec] + cm_cls
    inv_pos = 2 * ones > lengths
    plain = ~inv_pos[cseq]
    coded_seq.append(cseq[plain])
    coded_local.append(cm_rank[plain])
    inv_ids = pos_seq[inv_pos[pos_seq]]
    if inv_ids.numel():  # dense classes code their unchanged members: the complement of the ranks
        inv_len = lengths[inv_ids]
        inv_start = _excl(inv_len)
        slot = torch.full((total_seq,), -1, dtype=_I64, device=dev)
        slot[inv_ids] = torch.arange(inv_ids.numel(), device=dev)
        keep = torch.ones(int(inv_len.sum()), dtype=torch.bool, device=dev)
        mine = ~plain
        keep[inv_start[slot[cseq[mine]]] + cm_rank[mine]] = False
        zeros = torch.nonzero(keep).reshape(-1)
        zslot = torch.bucketize(zeros, inv_start, right=True) - 1
        coded_seq.append(inv_ids[zslot])
        coded_local.append(zeros - inv_start[zslot])

    # Value classes and levels, value-class-major within each record.
    vluts = _luts(vthresholds, dev)
    cm_v = vluts[cm_rec, cm_exp]
    vorder = torch.sort(cm_rec * 16 + cm_v, stable=True).indices
    v_rec, v_cls, v_mag = cm_rec[vorder], cm_v[vorder], cm_mag[vorder]
    n_v = torch.bincount(v_rec * 16 + v_cls, minlength=nrec * 16).reshape(nrec, 16)
    for lv in range(1, LEVELS + 1):
        member = v_mag >= lv
        g = (v_rec * 16 + v_cls)[member]
        local = _local_index(g, nrec * 16)
        s_rec, s_cls, s_mag = v_rec[member], v_cls[member], v_mag[member]
        sid = seq_base[s_rec] + kc[s_rec] + (lv - 1) * vc[s_rec] + s_cls
        lengths.index_add_(0, sid, torch.ones_like(sid))
        ones.index_add_(0, sid[s_mag > lv], torch.ones_like(sid[s_mag > lv]))
        inv = 2 * ones[sid] > lengths[sid]
        coded = (s_mag > lv) != inv
        coded_seq.append(sid[coded])
        coded_local.append(local[coded])
    tail = v_mag > LEVELS
    t_rec, t_cls, t_val = v_rec[tail], v_cls[tail], v_mag[tail] - LEVELS - 1
    invert = 2 * ones > lengths

    # Gaps of every coded sequence, in sequence order (each source lists a sequence's entries ascending).
    all_seq = torch.cat(coded_seq)
    all_local = torch.cat(coded_local)
    so = torch.sort(all_seq, stable=True).indices
    g_seq, g_local = all_seq[so], all_local[so]
    prev = torch.cat([torch.full((1,), -1, dtype=_I64, device=dev), g_local[:-1]])
    new_run = torch.ones_like(g_seq, dtype=torch.bool)
    new_run[1:] = g_seq[1:] != g_seq[:-1]
    gaps = g_local - torch.where(new_run, -1, prev) - 1
    gcount = torch.bincount(g_seq, minlength=total_seq)
    gsum = torch.zeros(total_seq, dtype=_I64, device=dev).index_add_(0, g_seq, gaps)
    tkey = t_rec * 16 + t_cls
    tcount = torch.bincount(tkey, minlength=nrec * 16)
    tsum = torch.zeros(nrec * 16, dtype=_I64, device=dev).index_add_(0, tkey, t_val)

    cand = rice_candidates(gcount.cpu().numpy(), gsum.cpu().numpy())
    tcand = rice_candidates(tcount.cpu().numpy(), tsum.cpu().numpy())
    ks = _pick_k(gaps, g_seq, cand, total_seq)
    tks = _pick_k(t_val, tkey, tcand, nrec * 16)

    # The streams: per record its gaps (sequence order), then its tails (value-class-major order).
    g_rec = torch.bucketize(g_seq, seq_base[1:], right=True) if nrec > 1 else torch.zeros_like(g_seq)
    sym_rec = torch.cat([g_rec, t_rec])
    sym_val = torch.cat([gaps, t_val])
    sym_k = torch.cat([ks[g_seq], tks[tkey]])
    sym_order = torch.sort(sym_rec, stable=True).indices
    sym_rec, sym_val, sym_k = sym_rec[sym_order], sym_val[sym_order], sym_k[sym_order]
    unary, ubytes = _write_stream(sym_rec, (sym_val >> sym_k) + 1, None, nrec, one_at_end=True)
    rem, rbytes = _write_stream(sym_rec, sym_k, sym_val & ((1 << sym_k) - 1), nrec, one_at_end=False)
    m_rec = torch.bincount(rec, minlength=nrec)
    neg, nbytes = _write_stream(cm_rec, torch.ones_like(cm_rec), cm_neg.to(_I64), nrec, one_at_end=False)

    host = [x.cpu().numpy() for x in (lengths, ones, invert, ks, tks.reshape(nrec, 16), n_v, m_rec, seq_base)]
    lengths_h, ones_h, invert_h, ks_h, tks_h, n_v_h, m_h, base_h = host
    streams = [(s.cpu().numpy().tobytes(), np.concatenate([[0], np.cumsum(b.cpu().numpy())])) for s, b in
               ((unary, ubytes), (rem, rbytes), (neg, nbytes))]
    for r in range(nrec):
        if m_h[r] == 0:
            continue
        k, v = ks_class[r], vs_class[r]
        sl = slice(int(base_h[r]), int(base_h[r]) + k + LEVELS * v)
        params = sequence_params(lengths_h[sl], ones_h[sl], invert_h[sl], ks_h[sl])
        parts = [data[off[r] : off[r + 1]] for data, off in streams]
        out[r] = write_payload(thresholds[r], vthresholds[r], n_v_h[r, :v], lengths_h[sl], ones_h[sl], params,
                               tks_h[r, :v], *parts)
    return out


def _choose_classes(
    sampled: np.ndarray, hist: np.ndarray, above: np.ndarray, tmax: np.ndarray, tsums: np.ndarray
) -> tuple[list[list[int]], list[list[int]]]:
    """Every record's position and value classes, with the CPU coder's code (:mod:`.classes`), in slices of
    records on host threads: the choice costs up to ~1 ms a record (records whose weights populate ~250
    exponents), and numpy releases the GIL on arrays that size."""
    def one(lo: int) -> tuple[list[list[int]], list[list[int]]]:
        sl = slice(lo, lo + _CHOICE_SLICE)
        return (choose_thresholds(sampled[sl], hist[sl]),
                choose_value_thresholds(hist[sl], above[:, sl], tmax[sl], lambda r, km: tsums[: km + 1, lo + r]))

    starts = range(0, hist.shape[0], _CHOICE_SLICE)
    with ThreadPoolExecutor(max_workers=min(len(starts), os.cpu_count() or 1)) as pool:
        parts = list(pool.map(one, starts))
    return [t for p, _ in parts for t in p], [v for _, p in parts for v in p]


def _pick_k(values: torch.Tensor, group: torch.Tensor, cand: np.ndarray, ngroups: int) -> torch.Tensor:
    """Per group the candidate Rice k coding its values in the fewest bits (the first on ties)."""
    c = torch.from_numpy(cand).to(values.device)
    costs = []
    for t in range(cand.shape[1]):
        k = c[group, t]
        costs.append(torch.zeros(ngroups, dtype=_I64, device=values.device).index_add_(0, group, (values >> k) + 1 + k))
    best = np.argmin(torch.stack(costs, 1).cpu().numpy(), axis=1)
    return c[torch.arange(ngroups, device=values.device), torch.from_numpy(best).to(values.device)]


def _write_stream(
    rec: torch.Tensor, width: torch.Tensor, value: torch.Tensor | None, nrec: int, *, one_at_end: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per record a byte-aligned bit stream of its symbols in order (``rec`` non-decreasing): each symbol
    takes ``width`` bits, either zeros then a one (unary) or the low bits of ``value``. Returns (all streams'
    bytes, bytes per record)."""
    dev = rec.device
    nbits = torch.zeros(nrec, dtype=_I64, device=dev).index_add_(0, rec, width)
    nbytes = (nbits + 7) // 8
    byte_start = _excl(nbytes)
    at = 8 * byte_start[rec] + _seg_excl(width, rec, nrec)
    bits = torch.zeros(8 * int(nbytes.sum()), dtype=torch.uint8, device=dev)
    if one_at_end:
        bits[at + width - 1] = 1
    else:
        wide = width > 0
        sym = torch.repeat_interleave(torch.nonzero(wide).reshape(-1), width[wide])
        within = torch.arange(sym.numel(), device=dev) - torch.repeat_interleave(_excl(width[wide]), width[wide])
        assert value is not None
        bits[at[sym] + within] = ((value[sym] >> within) & 1).to(torch.uint8)
    return _bits_to_bytes(bits), nbytes


# ------------------------------------------------------------------------------------------ decode


def _refuse(bad: torch.Tensor) -> None:
    """One host sync: raise if any check so far failed (before its results index anything)."""
    if bool(bad):
        raise ChunkCorrupt("SPARSE payload does not decode against these weights")


@dataclass(frozen=True)
class Payload:
    """Where a record's SPARSE payload is: ``buf[at:end]`` (the payload runs to a point the decoder finds)."""

    buf: np.ndarray
    at: int
    end: int


@dataclass(frozen=True)
class _Headers:
    """A batch's parsed SPARSE headers, flattened over records: every sequence's fields (position classes
    first, then level l of value class v at K + (l-1)·V + v), the value classes, and the three streams."""

    thresholds: list[list[int]]
    vthresholds: list[list[int]]
    n_v: torch.Tensor  # [records, 16] changes per value class
    k: torch.Tensor  # [records] position classes
    v: torch.Tensor  # [records] value classes
    length: torch.Tensor  # per sequence, and below
    ones: torch.Tensor
    coded: torch.Tensor  # symbols it codes
    rice_k: torch.Tensor
    invert: torch.Tensor
    tails: torch.Tensor  # per (record, value class): tail symbols and their k
    tail_k: torch.Tensor
    unary: list[np.ndarray]
    rem: list[np.ndarray]
    signs: list[np.ndarray]
    ends: list[int]

    @property
    def seq_base(self) -> torch.Tensor:
        return _excl(self.k + LEVELS * self.v)


def _parse_headers(
    payloads: Sequence[Payload], heads: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]], sizes: np.ndarray,
    dev: torch.device,
) -> _Headers:
    """The rest of every header, with the class sizes ``sizes`` [records, 8] (the CPU decoder's parsers)."""
    fields: list[list[np.ndarray]] = [[], [], [], [], [], [], []]
    unary, rem, signs, ends, n_vs = [], [], [], [], []
    for r, (p, (thr, vthr, n_v, at)) in enumerate(zip(payloads, heads, strict=True)):
        k, v = len(thr) + 1, len(vthr) + 1
        lengths, ones, params, tail_k, at, err = _k.parse_sequences(p.buf, at, p.end, sizes[r, :k].copy(), n_v, LEVELS)
        check(err)
        m = int(n_v.sum())
        spans, at, err = _k.parse_streams(p.buf, at, p.end, m, k, lengths, ones, params, tail_k, LEVELS)
        check(err)
        inv = np.where(params < 0, (ones == lengths) & (lengths > 0), (params & 0x80) != 0)
        coded = np.where(params < 0, 0, np.where(inv, lengths - ones, ones))
        rice_k = np.where(params < 0, 0, params & 0x3F)
        tails = ones[k + (LEVELS - 1) * v :]
        if ((coded > 0) & (rice_k > 62)).any() or ((tails > 0) & (tail_k > 62)).any():
            raise ChunkCorrupt(_b.ERRORS[_b.ERR_RANGE])
        for out, value in zip(fields, (lengths, ones, coded, rice_k, inv, tails, tail_k), strict=True):
            out.append(value)
        unary.append(p.buf[spans[0] : spans[0] + spans[1]])
        rem.append(p.buf[spans[2] : spans[2] + spans[3]])
        signs.append(p.buf[spans[4] : spans[4] + (m + 7) // 8])
        ends.append(at)
        n_vs.append(np.pad(n_v, (0, 16 - len(n_v))))
    per_seq = [torch.from_numpy(np.concatenate(f).astype(np.int64)).to(dev) for f in fields]
    return _Headers(
        [h[0].tolist() for h in heads], [h[1].tolist() for h in heads], torch.from_numpy(np.stack(n_vs)).to(dev),
        torch.tensor([len(h[0]) + 1 for h in heads], dtype=_I64, device=dev),
        torch.tensor([len(h[1]) + 1 for h in heads], dtype=_I64, device=dev),
        length=per_seq[0], ones=per_seq[1], coded=per_seq[2], rice_k=per_seq[3], invert=per_seq[4].to(torch.bool),
        tails=per_seq[5], tail_k=per_seq[6], unary=unary, rem=rem, signs=signs, ends=ends,
    )


def _concat(parts: list[np.ndarray], dev: torch.device, pad: int = 0) -> torch.Tensor:
    data = np.concatenate([*parts, np.zeros(pad, dtype=np.uint8)]) if parts or pad else np.zeros(0, np.uint8)
    return torch.from_numpy(data).to(dev)


def _rice_symbols(h: _Headers, nrec: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every Rice symbol of the batch: (its sequence, or −1 for a tail; its value; its record). Per record
    the coded symbols of its sequences in order, then its tails. Checks the unary streams' symbol counts and
    ends and every quotient's range (raises :class:`ChunkCorrupt`)."""
    dev = h.length.device
    nseq = h.k + LEVELS * h.v
    total_seq = int(nseq.sum())
    seq_rec = torch.repeat_interleave(torch.arange(nrec, device=dev), nseq)
    group_rec = torch.cat([seq_rec, torch.repeat_interleave(torch.arange(nrec, device=dev), h.v)])
    group_n = torch.cat([h.coded, h.tails])
    group_k = torch.cat([h.rice_k, h.tail_k])
    group_id = torch.cat([torch.arange(total_seq, device=dev), torch.full_like(h.tails, -1)])
    go = torch.sort(group_rec, stable=True).indices
    n = group_n[go]
    sym_id, sym_k, sym_rec = (torch.repeat_interleave(x[go], n) for x in (group_id, group_k, group_rec))
    nsym = int(sym_id.numel())
    per_rec = torch.bincount(sym_rec, minlength=nrec)

    ubytes = torch.tensor([len(b) for b in h.unary], dtype=_I64, device=dev)
    ustart = _excl(ubytes)
    one_at = torch.nonzero(_bytes_to_bits(_concat(h.unary, dev))).reshape(-1)
    if one_at.numel() != nsym:
        raise ChunkCorrupt(_b.ERRORS[_b.ERR_UNARY])
    one_rec = torch.bucketize(one_at >> 3, ustart[1:], right=True)
    last = torch.full((nrec,), -1, dtype=_I64, device=dev).scatter_reduce_(0, one_rec, one_at, reduce="amax")
    bad = (torch.bincount(one_rec, minlength=nrec) != per_rec).any()
    bad |= ((per_rec > 0) & ((last >> 3) != ustart + ubytes - 1)).any()
    prev = torch.cat([torch.full((1,), -1, dtype=_I64, device=dev), one_at[:-1]])
    first = torch.ones(nsym, dtype=torch.bool, device=dev)
    first[1:] = sym_rec[1:] != sym_rec[:-1]
    q = one_at - torch.where(first, 8 * ustart[sym_rec] - 1, prev) - 1
    bad |= ((q >> (62 - sym_k)) != 0).any()
    _refuse(bad)

    rstart = _excl(torch.tensor([len(b) for b in h.rem], dtype=_I64, device=dev))
    raw = _concat(h.rem, dev, pad=16)
    words = torch.nn.functional.pad(raw, (0, (-raw.numel()) % 8)).view(_I64)
    bit = 8 * rstart[sym_rec] + _seg_excl(sym_k, sym_rec, nrec)
    w, s = bit >> 6, bit & 63
    lo = torch.where(s == 0, words[w], (words[w] >> s) & ((1 << (64 - s)) - 1))
    hi = torch.where(s == 0, 0, words[w + 1] << (64 - s))
    return sym_id, (q << sym_k) | ((lo | hi) & ((1 << sym_k) - 1)), sym_rec


def _complement(seqs: torch.Tensor, local: torch.Tensor, dense: torch.Tensor, length: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ones of the sequences ``dense`` (coded by their zeros ``seqs``/``local``): (sequence, position)."""
    dev = length.device
    size = length[dense]
    start = _excl(size)
    slot = torch.full((length.numel(),), -1, dtype=_I64, device=dev)
    slot[dense] = torch.arange(dense.numel(), device=dev)
    keep = torch.ones(int(size.sum()), dtype=torch.bool, device=dev)
    keep[start[slot[seqs]] + local] = False
    kept = torch.nonzero(keep).reshape(-1)
    which = torch.bucketize(kept, start, right=True) - 1
    return dense[which], kept - start[which]


def decode_records(
    olds: Sequence[torch.Tensor], payloads: Sequence[Payload], fmt: _Float
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """Decode SPARSE payloads against records on a device: per record (positions ascending, new bit
    patterns as the signed integer view), on that device, and the offset after each payload. Raises
    :class:`ChunkCorrupt` for any payload the CPU decoder would reject, before returning anything."""
    tr = _triton()
    batch, old = _Batch.of(olds)
    dev = old.device
    nrec = len(olds)
    heads = []
    for pl, n in zip(payloads, batch.sizes, strict=True):
        thr, vthr, n_v, at, err = _k.parse_head(pl.buf, pl.at, pl.end, n, fmt.exp_count)
        check(err)
        heads.append((thr, vthr, n_v, at))
    bounds = _bounds([hd[0].tolist() for hd in heads], fmt, dev)
    cnts = tr.class_counts(old, batch.blocks, bounds, fmt.mag_mask)
    bases = tr.class_bases(cnts, batch.blocks)
    class_size = torch.zeros((nrec, 8), dtype=_I64, device=dev).index_add_(0, batch.blocks.record, cnts.to(_I64))
    h = _parse_headers(payloads, heads, class_size.cpu().numpy(), dev)
    seq_base = h.seq_base
    nseq = h.k + LEVELS * h.v
    seq_rec = torch.repeat_interleave(torch.arange(nrec, device=dev), nseq)
    seq_idx = torch.arange(int(nseq.sum()), device=dev) - seq_base[seq_rec]
    is_level = seq_idx >= h.k[seq_rec]
    m_rec = h.n_v.sum(1)

    # Positions within each sequence from the gaps.
    sym_id, value, _ = _rice_symbols(h, nrec)
    is_seq = sym_id >= 0
    sid = sym_id[is_seq]
    p = _seg_excl(value[is_seq] + 1, sid, int(nseq.sum())) + value[is_seq]
    _refuse((p >= h.length[sid]).any())  # positions index the rank map and member lists below
    tails = value[~is_seq]

    # Position classes → rank map (a byte per member rank: changed or not).
    pos_seq = torch.nonzero(~is_level).reshape(-1)
    pr, pc = seq_rec[pos_seq], seq_idx[pos_seq]
    map_len = torch.zeros((nrec, 8), dtype=_I64, device=dev)
    map_len[pr, pc] = h.length[pos_seq]
    map_start = _excl(map_len.reshape(-1)).reshape(nrec, 8)
    rank_map = torch.repeat_interleave(h.invert[pos_seq], h.length[pos_seq])  # dense classes: all but coded zeros
    in_pos = ~is_level[sid]
    ps = sid[in_pos]
    rank_map[map_start[seq_rec[ps], seq_idx[ps]] + p[in_pos]] = ~h.invert[ps]

    # Level sequences → their ones, sequence by sequence (dense ones as the complement of coded zeros).
    lid, llocal = sid[~in_pos], p[~in_pos]
    plain = ~h.invert[lid]
    e_id, e_local = [lid[plain]], [llocal[plain]]
    dense = torch.nonzero(is_level & h.invert).reshape(-1)
    if dense.numel():
        cid, clocal = _complement(lid[~plain], llocal[~plain], dense, h.length)
        e_id.append(cid)
        e_local.append(clocal)
    ids, locs = torch.cat(e_id), torch.cat(e_local)
    eo = torch.sort(ids, stable=True).indices
    ids, locs = ids[eo], locs[eo]

    # The changed positions, then their values (class-major and value-class-major as the CPU decoder).
    pos, cls = tr.select(old, batch.blocks, bounds, fmt.mag_mask, bases, map_start, rank_map.to(torch.uint8))
    rec = batch.record_of(pos)
    _refuse((torch.bincount(rec, minlength=nrec) != m_rec).any())
    bits = _new_values(old[pos], rec, cls, h, ids, locs, tails, seq_rec, seq_idx, fmt)
    starts = torch.tensor(batch.starts, dtype=_I64, device=dev)
    split = m_rec.cpu().tolist()
    return list(zip((pos - starts[rec]).split(split), bits.split(split), strict=True)), h.ends


def _new_values(
    old_bits: torch.Tensor, rec: torch.Tensor, cls: torch.Tensor, h: _Headers, ids: torch.Tensor,
    locs: torch.Tensor, tails: torch.Tensor, seq_rec: torch.Tensor, seq_idx: torch.Tensor, fmt: _Float,
) -> torch.Tensor:
    """New bit patterns (signed integer view) of the changed elements, in position order, from their old
    ones, the level sequences' ones (``ids``/``locs``, by sequence), the tails and the signs."""
    dev = rec.device
    nrec = h.k.numel()
    m = rec.numel()
    ob = _unsigned(old_bits, fmt)
    order = torch.sort(rec * 8 + cls.to(_I64), stable=True).indices
    cm_of = torch.empty_like(order)
    cm_of[order] = torch.arange(m, device=dev)
    cm_old, cm_rec = ob[order], rec[order]
    cm_v = _luts(h.vthresholds, dev)[cm_rec, (cm_old & fmt.mag_mask) >> fmt.mant]
    _refuse((torch.bincount(cm_rec * 16 + cm_v, minlength=nrec * 16).reshape(nrec, 16) != h.n_v).any())
    vorder = torch.sort(cm_rec * 16 + cm_v, stable=True).indices
    vidx = torch.empty_like(vorder)
    vidx[vorder] = torch.arange(m, device=dev)
    vstart = _excl(h.n_v.reshape(-1))
    vmag = torch.ones(m, dtype=_I64, device=dev)
    e_rec = seq_rec[ids]
    e_lv = (seq_idx[ids] - h.k[e_rec]) // h.v[e_rec]
    e_v = (seq_idx[ids] - h.k[e_rec]) % h.v[e_rec]
    # Level l's ones are ranks among level l-1's ones of their value class (level 1: the whole class).
    members = torch.zeros(0, dtype=_I64, device=dev)
    gstart = vstart
    for lv in range(LEVELS):
        mine = e_lv == lv
        g = e_rec[mine] * 16 + e_v[mine]
        here = vstart[g] + locs[mine] if lv == 0 else members[gstart[g] + locs[mine]]
        vmag.index_add_(0, here, torch.ones_like(here))
        members = here
        gstart = _excl(torch.bincount(g, minlength=nrec * 16))
    if tails.numel() != members.numel():
        raise ChunkCorrupt(_b.ERRORS[_b.ERR_OVERRUN])
    vmag.index_add_(0, members, tails)
    local_cm = torch.arange(m, device=dev) - _excl(h.n_v.sum(1))[cm_rec]
    nstart = _excl(torch.tensor([len(b) for b in h.signs], dtype=_I64, device=dev))
    neg = (_concat(h.signs, dev)[nstart[cm_rec] + (local_cm >> 3)].to(_I64) >> (local_cm & 7)) & 1
    mag = vmag[vidx]
    o = _ord(cm_old, fmt) + torch.where(neg == 1, -mag, mag)
    _refuse(((o > fmt.mag_mask) | (o < -fmt.mag_mask - 1)).any())
    new_cm = torch.where(o < 0, (-o - 1) | (1 << (fmt.bits - 1)), o)
    signed = torch.where(new_cm >= 1 << (fmt.bits - 1), new_cm - (1 << fmt.bits), new_cm).to(old_bits.dtype)
    return signed[cm_of]
