"""Plan selection: the fastest plan that fits, and why."""

from hf_dist_recipes.parallel.memory import GIB
from hf_dist_recipes.parallel.models import introspect
from hf_dist_recipes.parallel.plan import ParallelPlan
from hf_dist_recipes.parallel.suggest import compact_rows, reasons, render_candidates, suggest

V3 = introspect("deepseek-v3")
BASE = ParallelPlan(nodes=8, procs_per_node=8, seq_len=4096, activation_checkpointing=True)


def test_deepseek_v3_on_8_nodes_of_8_80gb_picks_the_fastest_fitting_plan_not_the_smallest():
    chosen, rows = suggest(BASE, V3, 80)
    assert chosen is not None and chosen.fits and chosen.memory.device_total < 80 * GIB * 0.9
    # Adam states of 671B parameters alone are 117 GiB per GPU on 64 GPUs: nothing fits without offload.
    assert not any(r.fits for r in rows if not r.plan.offload_optimizer)
    fitting = [r for r in rows if r.fits]
    assert chosen.step.tokens_per_s == max(r.step.tokens_per_s for r in fitting)
    # The first plan that fits (what a memory-only choice runs) has the least EP that fits: ZeRO-3 then gathers
    # most of the 256 experts of every MoE layer; the chosen plan moves far fewer bytes across nodes.
    first = fitting[0]
    assert first.plan.tp == 1 and first.plan.ep == min(r.plan.ep for r in fitting if r.plan.tp == 1)
    assert chosen.plan.ep > first.plan.ep and chosen.step.comm_inter_bytes < first.step.comm_inter_bytes / 2
    # Parameter offload costs PCIe traffic on every gather, so it is not chosen when optimizer offload fits.
    assert chosen.plan.offload_optimizer and not chosen.plan.offload_params
    why = reasons(chosen, rows)
    assert why[0].startswith(f"Z3 TP1 EP{chosen.plan.ep} off:opt") and "s/step" in why[0]
    assert any(f"smallest plan that fits, Z3 TP1 EP{first.plan.ep} off:opt" in line for line in why)
    table = render_candidates(rows, chosen=chosen)
    assert "step s" in table and table.count(" <") == 1


def test_plans_are_compared_by_tokens_per_second_not_step_time():
    # TP 8 on one node leaves one data-parallel rank: its steps are short because they train 8x fewer tokens.
    lite = introspect("deepseek-v2-lite")
    chosen, rows = suggest(ParallelPlan(nodes=1, procs_per_node=8, activation_checkpointing=True), lite, 80)
    shortest = min((r for r in rows if r.fits), key=lambda r: r.step.step_time_s)
    assert shortest.plan.tp == 8 and chosen.plan.tp < 8
    assert chosen.step.tokens_per_s > shortest.step.tokens_per_s
    assert chosen.step.tokens_per_s == chosen.plan.global_batch * chosen.plan.seq_len / chosen.step.step_time_s


def test_nothing_fits():
    chosen, rows = suggest(ParallelPlan(nodes=1, procs_per_node=2), V3, 8)
    assert chosen is None and rows and not any(r.fits for r in rows)


def test_compact_rows_keep_ep1_the_smallest_and_the_fastest_per_tp_and_the_choice():
    chosen, rows = suggest(BASE, V3, 80)
    compact = compact_rows(rows, chosen)
    assert chosen in compact and len(compact) < len(rows)
    for key in {(r.plan.offload_optimizer, r.plan.offload_params, r.plan.tp) for r in rows}:
        group = [r for r in rows if (r.plan.offload_optimizer, r.plan.offload_params, r.plan.tp) == key]
        kept = [r for r in compact if r in group]
        assert group[0] in kept
        assert min(r.memory.device_total for r in group) == min(r.memory.device_total for r in kept)
        fitting = [r for r in group if r.fits]
        if fitting:
            assert max(r.step.tokens_per_s for r in fitting) == max(r.step.tokens_per_s for r in kept if r.fits)
