import math
from dataclasses import replace

import pytest
import torch

from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.parallel.tiled_mlp import tile_mlps
from hf_dist_recipes.planning.memory import (
    activation_parts,
    estimate,
    layer_bytes_per_token,
    rank_elements,
)
from hf_dist_recipes.planning.models import introspect
from hf_dist_recipes.planning.plan import ParallelPlan

TINY = introspect("tiny-deepseek-v3")
V3 = introspect("deepseek-v3")
# tiny-deepseek-v3's parameters by hand (h 64, vocab 128, 4 heads, q/kv ranks 32/16, nope/rope/v 16/8/16, dense MLP
# 128, 8 experts 32 wide + 1 shared, 3 layers of which 2 MoE, untied head); test_models.py checks the real model.
_ATTN = 64 * 32 + 32 + 32 * 4 * 24 + 64 * (16 + 8) + 16 + 16 * 4 * (16 + 16) + 4 * 16 * 64  # 12,848
_MOE = _ATTN + 2 * 64 + 8 * (2 * 32 * 64 + 64 * 32) + 8 * 64 + 3 * 64 * 32  # experts, router, shared: 68,784
TINY_PARAMS = 2 * 128 * 64 + 64 + (_ATTN + 2 * 64 + 3 * 64 * 128) + 2 * _MOE  # 191,568


def activation_bytes(plan, model, **kwargs) -> int:
    """The activation estimate per rank, in bytes: the sum of `activation_parts`."""
    return sum(activation_parts(plan, model, **kwargs).values())


def test_zero3_without_tp_matches_deepspeeds_own_estimate():
    """DeepSpeed's estimate_zero3_model_states_mem_needs (stage3.py), per GPU: 4 B x largest layer, plus 18 B per
    parameter / GPUs without offload (2 B under optimizer offload, 0 under both offloads). Term by term ours:
    the 4 B are `gathered` (the bf16 layer, 2 B) + buffers["gathered_grads"] (its full-size bf16 gradient, 2 B);
    the 18 B are params (2) + grads (4: fp32 accumulation) + optimizer (12). Ours is larger only by the ceil
    padding of each tensor's partition (DeepSpeed's estimator floors the total once)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(template_config("demo-deepseek-v3"))
    total, largest = model_to_params(model)
    shape = introspect(template_config("demo-deepseek-v3"))
    assert (shape.total_params, shape.largest_layer_params) == (total, largest)
    for gpus in (2, 8):
        for opt_off, param_off in ((False, False), (True, False), (True, True)):
            _, ds_gpu, ds_layer = estimate_zero3_model_states_mem_needs(
                total, largest, num_gpus_per_node=gpus, cpu_offload=opt_off, cpu_offload_params=param_off
            )
            ours = estimate(
                ParallelPlan(procs_per_node=gpus, offload_optimizer=opt_off, offload_params=param_off), shape
            )
            assert ours.gathered + ours.buffers["gathered_grads"] == ds_layer == 4 * largest
            on_gpu = [ours.params * (not param_off), ours.grads * (not opt_off), ours.optimizer * (not opt_off)]
            gap = sum(on_gpu) + ds_layer - ds_gpu
            assert 0 <= gap <= 18 * len(shape.parameters), (gpus, opt_off, param_off, gap)
    # A gradient kept in bf16 (2 B, DeepSpeed's default without grad_accum_dtype) would fall 2 B per parameter
    # short of DeepSpeed's figure: the estimator assumes the fp32 gradient partitions the generated JSON asks for.
    ours = estimate(ParallelPlan(procs_per_node=8), shape)
    assert ours.grads == 2 * ours.params


def test_zero3_partitions_every_tensor_with_ceil():
    plan = ParallelPlan(procs_per_node=3, device="cpu", precision="fp32")
    el = rank_elements(plan, TINY)
    assert el.params == sum(math.ceil(math.prod(s) / 3) for _, s in TINY.parameters)
    assert el.sharded == TINY.total_params


def test_lower_zero_stages_keep_whole_copies():
    plan = ParallelPlan(procs_per_node=4, zero_stage=1)
    el = rank_elements(plan, TINY)
    assert el.params == el.grads == TINY.total_params and el.optimizer < TINY.total_params / 3
    assert rank_elements(replace(plan, zero_stage=2), TINY).grads == el.optimizer


def test_bytes_per_element_and_offload_placement():
    from hf_dist_recipes.planning.deepspeed_config import deepspeed_config

    plan = ParallelPlan(procs_per_node=8)
    # The generated JSON accumulates gradients in fp32, so a bf16 plan's gradient partitions take 4 B.
    assert deepspeed_config(plan)["data_types"] == {"grad_accum_dtype": "fp32"}
    base = estimate(plan, V3, device_gib=80)
    assert base.optimizer == 6 * base.params  # 12 B vs 2 B per element
    assert base.grads == 2 * base.params  # 4 B vs 2 B
    off = estimate(replace(plan, offload_optimizer=True), V3, device_gib=80)
    # Offload moves exactly the optimizer states and gradient partitions (and the optimizer step's fp32 sub-group
    # copy, which is not the peak here: the backward pass holds more than 3.7 GiB of activations).
    assert base.buffers["subgroup_fp32_grads"] < base.activations and off.buffers["subgroup_fp32_grads"] == 0
    assert off.device_total == base.device_total - base.optimizer - base.grads
    # On the host besides them: each optimizer sub-group's fp32 `.grad`, 4 B of the optimizer partition's 12 B.
    assert off.host_total_per_node == (base.optimizer + base.grads + base.optimizer // 3) * 8
    both = estimate(replace(plan, offload_optimizer=True, offload_params=True), V3)
    # With every model state on the host the GPU keeps the gathered layer, the ZeRO-3 buffers, the activations
    # and the allowance: 2 GiB plus a tenth of the backward peak.
    b = both.buffers
    peak = both.gathered + b["prefetched_params"] + b["gathered_grads"] + b["reduce_copy"] + both.activations
    assert both.allowance == int(2 * GIB + 0.1 * peak)
    assert both.device_total == peak + b["reduce_bucket"] + both.allowance and both.fits is None
    fp32 = estimate(replace(plan, precision="fp32"), V3)
    # ZeRO keeps its own fp32 master partition beside fp32 parameters: 12 optimizer bytes either way (issue 40,
    # measured in test_offload_autoep); without ZeRO the fp32 parameter is the master (8).
    assert fp32.params == 2 * base.params and fp32.optimizer == base.optimizer
    plain = estimate(replace(plan, precision="fp32", zero_stage=0), V3)
    assert plain.optimizer == plain.elements.optimizer * 8
    assert fp32.grads == base.grads  # fp32 either way


def test_activation_formula_and_checkpointing():
    """DeepSeek-V3 at TP 2, bf16 (c = 2 B; an RMSNorm over w keeps (4 + 2c) x w + 4 B), per token and layer:
    MLA attention: norms over 7168, 1536, 512 (57,348 + 12,292 + 4,100) + 2 x 128 x (2 x 192 + 256 + 128) / 2;
    dense MLP (3 layers): 57,348 + 4 x 2 x 18432 / 2;
    MoE (58 layers): 57,348 + 4 x 7168 (fp32 router input) + 2 x 8 x (2 x 7168 + 4 x 2048) + 4 x 2 x 2048 / 2.
    EP 1: no all-to-all copies. Logits: TP 2 turns the vocabulary-parallel head on (it saves more than 1 GiB
    here), 4096 x 129280 / 2 logits at 14 B."""
    plan = ParallelPlan(seq_len=4096, micro_batch=1, tp=2)
    tokens, h = 4096, 7168
    attention = 57_348 + 12_292 + 4_100 + 98_304
    dense, moe = attention + 57_348 + 73_728, attention + 57_348 + 28_672 + 360_448 + 8_192
    logits = 4096 * 64_640 * 14
    assert activation_bytes(plan, V3) == tokens * (3 * dense + 58 * moe) + logits
    # At TP 1 the MLA attention is 2.9x the attention part of the dense formula s*b*h*(10 + 24/t) (13*h at t = 1):
    # the docstring's norms 57,348 + 12,292 + 4,100 = 73,740 and 2 x 128 x (2 x 192 + 256 + 128) = 196,608 unsplit.
    assert 73_740 + 196_608 == pytest.approx(2.9 * 13 * h, rel=0.01)
    ckpt = activation_bytes(replace(plan, activation_checkpointing=True), V3)
    assert ckpt == tokens * 61 * 2 * h + tokens * moe + logits
    ep = activation_bytes(replace(plan, ep=8), V3, routing_imbalance=1.0)
    assert ep - activation_bytes(plan, V3) == tokens * 2 * 2 * 8 * h  # AutoEP's send and receive copies
    # Under EP the routed part is sized for the busiest rank: at twice the mean, every MoE layer's routed bytes
    # (2 x 8 x (2 x 7168 + 4 x 2048) per token) and the receive copy (2 x 8 x 7168) once more.
    busy = activation_bytes(replace(plan, ep=8), V3, routing_imbalance=2.0)
    assert busy - ep == tokens * (58 * 2 * 8 * (2 * h + 4 * 2048) + 2 * 8 * h)


def test_each_term_of_a_tiny_deepseek_by_hand():
    """tiny-deepseek-v3 (h 64, 4 heads, q/kv ranks 32/16, nope/rope/v 16/8/16, dense MLP 128, experts 8 x 32 wide,
    top 2, one shared expert 32 wide, 3 layers of which 2 MoE, vocab 128) on 2 GPUs, ZeRO-3, bf16."""
    plan = ParallelPlan(procs_per_node=2, seq_len=64, micro_batch=2)
    e = estimate(plan, TINY, device_gib=80)
    experts = 8 * 64 * 64 + 8 * 64 * 32  # layer 1's experts module: gate_up_proj + down_proj = 49,152
    assert e.elements.gathered_layer == experts and e.gathered == 2 * experts
    # Live-parameter budget: max(1e9, 2 x 49,152) + the 32,768-element gate_up_proj, more than the whole model.
    assert e.buffers["prefetched_params"] == (TINY_PARAMS - experts) * 2
    assert e.buffers["gathered_grads"] == experts * 2
    assert e.buffers["reduce_bucket"] == 500_000_000 * 2
    # A bucket holds at most the model; reduced in fp32 (the default), the bf16 gradients' fp32 copy and its
    # interleaved copy are both alive during the reduce-scatter: 4 + 4 bytes; reduced in bf16, only the latter.
    assert e.buffers["reduce_copy"] == TINY_PARAMS * (4 + 4)
    bf16 = estimate(replace(plan, grad_reduce_dtype="bf16"), TINY, device_gib=80)
    assert bf16.buffers["reduce_copy"] == TINY_PARAMS * 2
    half = sum(math.ceil(math.prod(s) / 2) for _, s in TINY.parameters)
    assert e.buffers["subgroup_fp32_grads"] == half * 4  # one sub-group: the whole partition, < 1e9
    assert e.buffers["hpz_secondary"] == 0
    norm = {w: (4 + 2 * 2) * w + 4 for w in (64, 32, 16)}  # RMSNorm: fp32 input, normalised, output, 1/rms
    per_token = {
        "attention": norm[64] + norm[32] + norm[16] + 2 * 4 * (2 * (16 + 8) + (16 + 16) + 16),  # 908 + 768
        "dense": norm[64] + 4 * 2 * 128,  # 516 + 1024
        "moe": norm[64] + 4 * 64 + 2 * 2 * (2 * 64 + 4 * 32) + 4 * 2 * 32,  # 516 + 256 + 1024 + 256
    }
    tokens = 128
    layers = tokens * (per_token["attention"] + per_token["dense"] + 2 * (per_token["attention"] + per_token["moe"]))
    assert e.activation_parts == {"layers": layers, "recomputed_layer": 0, "dispatch": 0, "logits": 128 * 128 * 12}
    states = half * (2 + 4 + 12)
    b = e.buffers
    backward = e.gathered + b["prefetched_params"] + b["gathered_grads"] + TINY_PARAMS * (4 + 4) + e.activations
    assert backward > e.buffers["subgroup_fp32_grads"]
    assert e.allowance == int(2 * GIB + 0.1 * backward)
    assert e.device_total == states + 500_000_000 * 2 + backward + e.allowance
    assert e.other == e.device_total - states - e.gathered - e.activations
    # On CPU plans no allowance for the CUDA context and NCCL.
    assert estimate(replace(plan, device="cpu"), TINY).allowance == 0


def test_dense_gqa_attention_and_mlp_by_hand():
    """tiny-llama (h 64, 4 heads of 16, 4 KV heads, MLP 128, 2 layers, vocab 256), fp32 (c = 4), TP 2: norm
    (4 + 8) x 64 + 4 = 772; attention 772 + 4 x 16 x (2 x 4 / 2 + 2 x 4 / 2) = 772 + 512; MLP 772 + 4 x 4 x 128 / 2
    = 772 + 1024."""
    llama = introspect("tiny-llama")
    plan = ParallelPlan(procs_per_node=2, device="cpu", precision="fp32", tp=2, seq_len=32, micro_batch=1)
    parts = estimate(plan, llama).activation_parts
    assert parts["layers"] == 32 * 2 * (772 + 512 + 772 + 1024)
    assert parts["logits"] == 32 * 256 * 12  # far under 1 GiB saved: the gathered head stays


class _FlashLike(torch.autograd.Function):
    """Stands in for the GPU FlashAttention kernel (none on a CPU machine): it keeps q, k, v and its output,
    written (batch, seq, heads, dim) as flash writes it. Forward only: the test counts what is saved."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out = out.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out)
        return out


def _saved_bytes_per_token(name: str, seq: int = 64, batch: int = 2, tiled: int = 0) -> list[float]:
    """Bytes of the storages autograd keeps in each decoder layer of template `name` (bf16, one CPU process),
    leaving out the parameters and the rotary tables that all layers share; `tiled`: the MLPs in that many slices
    (`parallel.tiled_mlp`, 0: whole)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["hf_dist_recipes_saved_probe"] = lambda module, q, k, v, mask, scaling=None, **kw: (
        _FlashLike.apply(q, k, v, scaling),
        None,
    )
    config = template_config(name)
    config._attn_implementation = "hf_dist_recipes_saved_probe"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()
    tile_mlps(model, tiled)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
    hidden.requires_grad_(True)
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    rotary = model.model.rotary_emb(hidden, positions)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in rotary}
    out = []
    for layer in model.model.layers:
        kept: dict[int, int] = {}

        def pack(t, kept=kept):  # the hook runs within this iteration
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)
        out.append(sum(kept.values()) / (seq * batch))
    return out


def test_layer_formula_equals_what_autograd_keeps():
    """A plain single-process forward: the bytes autograd keeps per token in each decoder layer, against the
    formula. Dense layers match exactly; MoE layers keep the router's small E-wide scores and indices on top."""
    plan = ParallelPlan(precision="bf16")
    llama = _saved_bytes_per_token("tiny-llama")
    # The independent figure is the autograd count (`llama`); 2,568 pins it so a change in either side shows.
    assert llama == [layer_bytes_per_token(plan, introspect("tiny-llama"), moe=False)] * 2 == [2568.0] * 2
    dense, *moe = _saved_bytes_per_token("tiny-deepseek-v3")
    # 3,216 = attention 908 + 768 and dense MLP 516 + 1,024, by hand in test_each_term_of_a_tiny_deepseek_by_hand
    assert dense == layer_bytes_per_token(plan, TINY, moe=False) == 3216.0
    formula = layer_bytes_per_token(plan, TINY, moe=True)
    assert all(0 <= m - formula <= 0.05 * formula for m in moe), (moe, formula)


def test_tiled_mlps_keep_what_the_formula_says():
    """Tiled, a gated MLP's forward runs without autograd: what autograd keeps per token loses the four intermediates
    (tiny DeepSeek-V3's dense MLP: 4 x bf16 x 128 = 1,024 of its 3,216 bytes; its MoE layers' shared experts)."""
    plan = ParallelPlan(precision="bf16", tiled_mlp_shards=4)
    dense, *moe = _saved_bytes_per_token("tiny-deepseek-v3", tiled=4)
    assert dense == layer_bytes_per_token(plan, TINY, moe=False) == 3216.0 - 1024
    formula = layer_bytes_per_token(plan, TINY, moe=True)
    whole = layer_bytes_per_token(replace(plan, tiled_mlp_shards=None), TINY, moe=True)
    assert whole - formula == 4 * 2 * TINY.shared_intermediate_size
    # On top, as untiled: the router's E-wide scores and indices (the same bytes, so the untiled allowance)
    assert all(0 <= m - formula <= 0.05 * whole for m in moe), (moe, formula)
    # One slice in its backward pass: a quarter of the rank's tokens' intermediates, and the input's gradient.
    tokens = 4096
    parts = activation_parts(replace(plan, seq_len=tokens), TINY)
    assert parts["mlp_slice"] == tokens // 4 * 4 * 2 * 128 + tokens * 2 * TINY.hidden_size
    with pytest.raises(ValueError, match="tiled_mlp_shards must be a whole number of slices >= 2"):
        replace(plan, tiled_mlp_shards=1).validate()
    with pytest.raises(ValueError, match="--tiled-mlp-shards with --engine fsdp2"):
        replace(plan, engine="fsdp2").validate()


def test_ep_divides_the_experts_and_tp_the_split_weights():
    z3 = rank_elements(ParallelPlan(procs_per_node=8), V3)
    ep8 = rank_elements(ParallelPlan(procs_per_node=8, ep=8), V3)
    assert ep8.gathered_layer == z3.gathered_layer // 8  # one layer's experts gathered: 32 of 256
    tp8 = rank_elements(ParallelPlan(procs_per_node=8, tp=8, ep=8), V3)
    assert tp8.sharded < ep8.sharded


def test_sp_divides_every_activation_term_by_the_tokens_a_rank_holds():
    llama = introspect("llama-3.1-8b")  # 32 layers, h 4096, 32 heads / 8 KV heads of 128, vocab 128,256
    plan = ParallelPlan(nodes=1, procs_per_node=8, seq_len=32768, activation_checkpointing=True)
    whole, quarter = activation_parts(plan, llama), activation_parts(replace(plan, sp=4), llama)
    tokens = 32768 // 4  # a rank of an SP-4 group holds a quarter of the sequence
    # With checkpointing each layer keeps its bf16 input: 32 layers x 2 bytes x 4096 per token.
    assert quarter["layers"] == tokens * 32 * 2 * 4096 == whole["layers"] // 4
    assert quarter["logits"] == tokens * 128256 * 12 == whole["logits"] // 4  # the stock loss's 3 fp32 copies
    assert abs(quarter["recomputed_layer"] - whole["recomputed_layer"] / 4) <= 1
    # One layer's Ulysses copies (send and receive): query and output 32 x 128, key and value max(8, 4) x 128 each.
    assert quarter["sp_exchange"] == tokens * 2 * 2 * 128 * (2 * 32 + 2 * 8)
    assert "sp_exchange" not in whole
    # The chunked loss holds one chunk, at most the rank's own tokens.
    chunked = replace(plan, sp=8, loss_chunk_tokens=8192)
    assert activation_parts(chunked, llama)["logits"] == 4096 * 128256 * 12


def test_sp_keeps_zero_partitions_over_the_whole_world():
    # DeepSpeed partitions over its sequence-data-parallel group (every rank), not over world / sp data-parallel ranks.
    plan = ParallelPlan(nodes=1, procs_per_node=8, seq_len=32768)
    assert rank_elements(replace(plan, sp=8), TINY) == rank_elements(plan, TINY)
    lite = introspect("deepseek-v2-lite")
    with_sp, without = estimate(replace(plan, sp=8), lite), estimate(plan, lite)
    assert (with_sp.params, with_sp.grads, with_sp.optimizer) == (without.params, without.grads, without.optimizer)
    assert with_sp.activations < without.activations / 7


def test_ulysses_all_to_all_traffic_per_layer_by_hand():
    from hf_dist_recipes.planning.comm import compute_flops, traffic

    lite = introspect("deepseek-v2-lite")  # 27 layers, 16 heads, MLA query/key 128 + 64 wide (value padded to it)
    plan = ParallelPlan(nodes=1, procs_per_node=8, seq_len=131072, sp=8, grad_accum=2, activation_checkpointing=True)
    sent = 131072 // 8 * 4 * 16 * 192 * 2  # bytes per rank per layer: s/sp tokens x q, k, v, output x bf16
    t = traffic(plan, lite)
    # (sp-1)/sp of it leaves the rank, inside the node; forward, backward and recomputation; each micro step.
    assert t.intra["sp"] == pytest.approx(7 / 8 * sent * 27 * 3 * 2)
    assert t.inter["sp"] == 0
    # Across two nodes an SP group of 16 sends half of the other ranks' shares over the network.
    two = replace(plan, nodes=2, sp=16, grad_accum=1)
    sent16 = 131072 // 16 * 4 * 16 * 192 * 2
    assert traffic(two, lite).inter["sp"] == pytest.approx(8 / 16 * sent16 * 27 * 3)
    # Each rank computes its s/sp tokens: the step's FLOPs divide by sp.
    assert compute_flops(plan, lite) == pytest.approx(compute_flops(replace(plan, sp=1), lite) / 8)
