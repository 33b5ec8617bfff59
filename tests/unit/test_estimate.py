"""The memory model against numbers computed by hand from the ZeRO paper's formulas (Ψ = 1000 unless said)."""

import pytest

from lightning_zero import config, estimate
from lightning_zero.estimate import EstimateError, MemoryEstimate, PeakInputs, peak_estimate
from lightning_zero.step_measure import StepMeasure

PSI = 1000


def _kinds(e: MemoryEstimate) -> tuple[int, int, int, int]:
    return e.params, e.grads, e.optimizer, e.total


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("ddp", (4000, 4000, 8000, 16000)),  # 16Ψ
        ("zero1", (4000, 4000, 2000, 10000)),  # 8Ψ + 8Ψ/4
        ("zero2", (4000, 1000, 2000, 7000)),  # 4Ψ + 12Ψ/4
        ("zero3", (1000, 1000, 2000, 4000)),  # 16Ψ/4
    ],
)
def test_fp32_on_four_ranks(option, expected):
    assert _kinds(estimate.estimate(option, PSI, 4, "32-true", bucket_mb=0)) == expected


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("ddp", (2000, 2000, 12000, 16000)),  # 16Ψ
        ("zero1", (2000, 2000, 3000, 7000)),  # 4Ψ + 12Ψ/4
        ("zero2", (2000, 500, 3000, 5500)),  # 2Ψ + 14Ψ/4
        ("zero3", (500, 500, 3000, 4000)),  # 16Ψ/4
    ],
)
def test_mixed_precision_on_four_ranks(precision, option, expected):
    assert _kinds(estimate.estimate(option, PSI, 4, precision, bucket_mb=0)) == expected


def test_buckets_are_added_to_zero_options_only():
    million = 10**6
    assert estimate.estimate("ddp", million, 4, bucket_mb=1).buckets == 0
    zero2 = estimate.estimate("zero2", million, 4, bucket_mb=1)
    assert zero2.buckets == 1_048_576
    assert zero2.model_states == 7 * million
    assert zero2.total == 7 * million + 1_048_576


def test_a_bucket_is_never_larger_than_all_parameters():
    assert estimate.estimate("zero2", PSI, 4, "32-true", bucket_mb=1).buckets == 4000
    assert estimate.estimate("zero3", PSI, 4, "bf16-mixed", bucket_mb=1).buckets == 2000


def test_uneven_shards_count_the_largest():
    # 1001 fp32 elements on 4 ranks: the largest shard holds ceil(1001/4) = 251 elements.
    assert _kinds(estimate.estimate("zero3", 1001, 4, bucket_mb=0)) == (1004, 1004, 2008, 4016)


def test_frozen_parameters_hold_no_gradient_nor_optimizer_state():
    e = estimate.estimate("zero2", PSI, 2, bucket_mb=0, trainable_params=250)
    assert _kinds(e) == (4000, 500, 1000, 5500)


def test_one_rank_shards_nothing():
    totals = {e.option: e.total for e in estimate.estimate_all(PSI, 1, bucket_mb=0, options=estimate.IN_DEVICE_OPTIONS)}
    assert totals == {"ddp": 16000, "zero1": 16000, "zero2": 16000, "zero3": 16000}


@pytest.mark.parametrize(("budget", "choice"), [(16000, "ddp"), (12000, "zero1"), (7000, "zero2"), (6999, "zero3")])
def test_recommend_picks_the_least_complex_option_that_fits(budget, choice):
    recommendation = estimate.recommend(PSI, 4, budget, bucket_mb=0)
    assert recommendation.choice == choice
    assert recommendation.min_ranks is None
    assert recommendation.explain().startswith(f"{choice}: the least complex option that fits")


def test_recommend_says_when_nothing_fits_and_how_many_ranks_would():
    recommendation = estimate.recommend(PSI, 4, 3999, bucket_mb=0)
    assert recommendation.choice is None
    # zero3 holds 16000/N bytes: 4000 > 3999 on 4 ranks, 3200 on 5.
    assert recommendation.min_ranks == 5
    assert recommendation.explain() == (
        "nothing fits: zero3 needs 3.91 KiB per rank on 4 ranks, the budget is 3.91 KiB; zero3 fits on 5 ranks or more"
    )


def test_recommend_within_implemented_options():
    recommendation = estimate.recommend(PSI, 4, 5000, bucket_mb=0, options=("ddp", "zero1", "zero2"))
    assert recommendation.choice is None
    assert [e.option for e in recommendation.estimates] == ["ddp", "zero1", "zero2"]
    # zero2 keeps 4000 bytes of parameters and shards the rest: 4000 + 84*4 + 84*8 = 5008 on 12 ranks, 4924 on 13.
    assert recommendation.min_ranks == 13


def test_recommend_when_no_number_of_ranks_fits():
    recommendation = estimate.recommend(PSI, 4, 3000, bucket_mb=0, options=("ddp", "zero2"))
    assert recommendation.choice is None and recommendation.min_ranks is None
    assert "no number of ranks fits" in recommendation.explain()


@pytest.mark.parametrize(
    ("option", "trainable", "expected"),
    [
        ("ddp", None, 6000),  # 2Ψ (N-1)/N elements of 4 bytes
        ("zero1", None, 6000),
        ("zero2", None, 6000),
        ("zero3", None, 9000),  # 3Ψ (N-1)/N
        ("ddp", 250, 1500),  # only trainable parameters are reduced
        ("zero3", 250, 6750),  # (2Ψ + Ψ_t)(N-1)/N
    ],
)
def test_communication_bytes(option, trainable, expected):
    assert estimate.communication_bytes(option, PSI, 4, 4, trainable) == expected


@pytest.mark.parametrize(
    ("text", "count"), [("350000", 350_000), ("125M", 125_000_000), ("1.3B", 1_300_000_000), ("7e9", 7 * 10**9)]
)
def test_parse_count(text, count):
    assert estimate.parse_count(text) == count


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: estimate.estimate("zero4", PSI, 4), "option='zero4' is invalid: allowed values are ddp, zero1, zero2"),
        (lambda: estimate.estimate("zero2", PSI, 4, "fp8"), "precision='fp8' is invalid: allowed values are 32-true"),
        (lambda: estimate.estimate("zero2", PSI, 0), "ranks=0 is invalid: it must be an integer >= 1"),
        (lambda: estimate.estimate("zero2", 0, 4), "num_params=0 is invalid"),
        (lambda: estimate.estimate("zero2", PSI, 4, trainable_params=PSI + 1), "trainable_params=1001 is invalid"),
        (lambda: estimate.recommend(PSI, 4, 0), "budget_bytes=0 is invalid"),
        (lambda: estimate.estimate("zero2", PSI, 4, bucket_mb=float("inf")), "bucket_mb=inf is invalid: it must be"),
        (lambda: estimate.parse_count("7Q"), "params='7Q' is invalid"),
        (lambda: estimate.parse_count("0"), "params='0' is invalid"),
    ],
)
def test_bad_input_names_the_field(call, message):
    with pytest.raises(EstimateError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        call()


# ------------------------------------------------------------------------------------------------------- offload
# Ψ = 1000 on N = 4 ranks, bucket_mb=0. Offloaded optimizer state is 12 bytes per element in any precision (a separate
# fp32 master and the two moments). Host buffers: the staging of the gradient shards (w Ψ/N) and, when the working
# parameters stay on the device, of the updated rows (w Ψ/N); disk offload adds its resident sub-groups.

# (option, precision): (params, grads, optimizer, device, host, disk, host_buffers)
OFFLOAD_CASES = {
    # ZeRO-Offload stage 2 in 16-bit: 2Ψ + 2Ψ/N = 2500 on the device, 12Ψ/N = 3000 on the host.
    ("zero2_offload", "bf16-mixed"): (2000, 500, 3000, 2500, 3000, 0, 1000),
    ("zero1_offload", "bf16-mixed"): (2000, 2000, 3000, 4000, 3000, 0, 1000),  # full gradients stay: 2Ψ + 2Ψ
    ("zero3_offload", "bf16-mixed"): (500, 500, 3000, 1000, 3000, 0, 1000),  # 2Ψ/N + 2Ψ/N
    ("zero3_offload_params", "bf16-mixed"): (500, 500, 3000, 500, 3500, 0, 500),  # only the gradient shards stay
    # fp32: 4Ψ + 4Ψ/N on the device, the same 12Ψ/N on the host.
    ("zero2_offload", "32-true"): (4000, 1000, 3000, 5000, 3000, 0, 2000),
    ("zero3_offload_params", "32-true"): (1000, 1000, 3000, 1000, 4000, 0, 1000),
    # Disk: the same bytes in files; the default sub-groups (3 x 256 MiB) hold all of this tiny model's files.
    ("zero2_offload_disk", "bf16-mixed"): (2000, 500, 3000, 2500, 0, 3000, 1000 + 3000),
    ("zero3_offload_disk", "bf16-mixed"): (500, 500, 3000, 500, 0, 3500, 500 + 3500),
}


@pytest.mark.parametrize(("option", "precision"), list(OFFLOAD_CASES))
def test_offload_bytes_by_placement(option, precision):
    e = estimate.estimate(option, PSI, 4, precision, bucket_mb=0)
    got = (e.params, e.grads, e.optimizer, e.device, e.host, e.disk, e.host_buffers)
    assert got == OFFLOAD_CASES[option, precision]
    assert e.device + e.host + e.disk == e.total
    assert e.host_total == e.host + e.host_buffers


def test_disk_offload_keeps_its_resident_subgroups_in_host_memory():
    # Ψ = 10^9 on 8 ranks, 16-bit, zero3_offload_disk: 14Ψ/N = 1.75e9 bytes of files per rank; 3 resident sub-groups
    # of 16 MiB of fp32 masters hold 3 x 16 MiB x (12 + 2) / 4 = 168 MiB; plus the gradient staging 2Ψ/N = 2.5e8.
    offload = config.OffloadConfig(offload_subgroup_mb=16.0, offload_resident_subgroups=3)
    e = estimate.estimate("zero3_offload_disk", 10**9, 8, "bf16-mixed", bucket_mb=0, offload=offload)
    assert (e.device, e.host, e.disk) == (250_000_000, 0, 1_750_000_000)
    assert e.host_buffers == 250_000_000 + 168 * 2**20


def _budget(device, host=None, disk=None, shared_host=False):
    return estimate.Budget(device, host, disk, shared_host)


@pytest.mark.parametrize(
    ("budget", "choice"),
    [
        # 16-bit, Ψ = 1000, N = 4: zero3 needs 4000 on the device; zero1/2/3_offload 4000/2500/1000 with 4000 on the
        # host (states and buffers); zero3_offload_params 500 with 4000; the disk options 4000/2500/500 on the device
        # with 4000 (4000 for zero3) of host buffers and 3000 (3500) of files.
        (_budget(4000), "zero3"),
        (_budget(3999), None),  # no host budget: the offload options are not considered
        (_budget(3999, host=4000), "zero2_offload"),
        (_budget(2499, host=4000), "zero3_offload"),
        (_budget(999, host=4000), "zero3_offload_params"),
        (_budget(999, host=3999, disk=10**6), None),  # every offload option needs 4000 of host memory
        (_budget(2500, host=4000, disk=10**6), "zero2_offload"),  # host before disk
        # On CPU the device is host memory: host offload never lowers what a rank holds; nothing fits.
        (_budget(3999, host=10**6, shared_host=True), None),
    ],
)
def test_recommend_tries_the_device_then_the_host_then_disk(budget, choice):
    assert estimate.recommend(PSI, 4, budget, "bf16-mixed", bucket_mb=0).choice == choice


def test_recommend_picks_disk_when_host_memory_is_short():
    # A 10^8-parameter model on 4 ranks in 16-bit: zero3_offload_params needs 14Ψ/N = 3.5e8 bytes of host states plus
    # 5e7 of staging, more than the host budget; disk offload keeps 2 resident sub-groups of 16 MiB of masters (a
    # quarter of the host budget cannot hold 3 of the largest), 2 x 16 MiB x 14/4 = 112 MiB, plus the same 5e7 of
    # staging.
    offload = config.OffloadConfig(offload_subgroup_mb=16.0)
    budget = estimate.Budget(device=2 * 10**8, host=39 * 10**7, disk=10**10)
    recommendation = estimate.recommend(10**8, 4, budget, "bf16-mixed", bucket_mb=0, offload=offload)
    assert recommendation.choice == "zero3_offload_disk"
    disk = next(e for e in recommendation.estimates if e.option == "zero3_offload_disk")
    assert (disk.device, disk.disk, disk.host_buffers) == (5 * 10**7, 35 * 10**7, 5 * 10**7 + 112 * 2**20)
    assert (disk.subgroups.subgroup_bytes, disk.subgroups.resident) == (16 * 2**20, 2)
    assert recommendation.explain() == (
        "zero3_offload_disk: the least complex option that fits (47.68 MiB of 190.73 MiB on the device, 159.68 MiB of "
        "371.93 MiB of host memory, 333.79 MiB of 9.31 GiB on disk per rank); nothing without offload fits (zero3 "
        "needs 381.47 MiB of 190.73 MiB on the device per rank); nothing with host offload fits "
        "(zero3_offload_params needs 47.68 MiB of 190.73 MiB on the device, 381.47 MiB of 371.93 MiB of host memory "
        "per rank)"
    )


def test_layouts_name_the_strategy_options():
    assert estimate.LAYOUTS["zero3_offload_disk"].strategy_options() == {
        "stage": 3, "offload_optimizer": "disk", "offload_params": "disk"
    }
    assert estimate.option_name(2, "cpu") == "zero2_offload"
    assert estimate.option_name(3, "disk", None) is None  # a valid combination the model has no option for
    assert estimate.IN_DEVICE_OPTIONS == ("ddp", "zero1", "zero2", "zero3")
    # offload moves states, not traffic: the same bytes as the stage
    traffic = estimate.communication_bytes
    assert traffic("zero3_offload_disk", PSI, 4, 4) == traffic("zero3", PSI, 4, 4)


# ---------------------------------------------------------------------------------------------------------------------
# the peak of a run ([Note: the peak of a run])
# ---------------------------------------------------------------------------------------------------------------------

MIB = 2**20
STEP = StepMeasure(baseline=300 * MIB, activation_per_sample=10 * MIB, activation_fixed=4 * MIB,
                   unit_elements=1_000_000, root_unit_elements=250_000)
N_PARAMS = 8_000_000  # 32,000,000 bytes in fp32 (below: Ψ)


def test_peak_of_a_zero3_step_adds_units_activations_and_the_adam_workspace():
    p = peak_estimate("zero3", N_PARAMS, 2, STEP, batch=3, bucket_mb=1.0)
    units = 4 * 250_000 + 3 * 4 * 1_000_000  # the root unit; the unit computing, one prefetched, one of gradients
    step = 300 * MIB + 16 * N_PARAMS // 2 + MIB + units + (4 + 3 * 10) * MIB + 4 * N_PARAMS // 2
    assert p.phases["first_step"] == p.phases["steady_step"] == step
    assert p.phases["import_build"] == 300 * MIB + 4 * N_PARAMS  # the eager model
    assert p.phases["setup"] == 300 * MIB + 4 * N_PARAMS + 4 * N_PARAMS // 2 + 4 * 1_000_000  # + the shards and one unit
    # the full model gathered back into the module; on a CPU device the step's transients were handed back
    teardown = 300 * MIB + 16 * N_PARAMS // 2 + 4 * N_PARAMS + units + MIB
    assert p.phases["teardown"] == teardown
    assert p.peak == max(step, teardown)
    # on CUDA the caching allocator keeps the step's blocks: the teardown adds the full model to the step's peak
    on_gpu = peak_estimate("zero3", N_PARAMS, 2, STEP, batch=3, bucket_mb=1.0, shared_host=False)
    assert on_gpu.phases["teardown"] == on_gpu.phases["steady_step"] + 4 * N_PARAMS


def test_peak_of_ddp_counts_its_gradient_buckets_at_setup_and_a_full_workspace():
    p = peak_estimate("ddp", N_PARAMS, 2, STEP, batch=1)
    assert p.phases["setup"] == 300 * MIB + 8 * N_PARAMS
    assert p.phases["steady_step"] == 300 * MIB + 16 * N_PARAMS + 14 * MIB + 4 * N_PARAMS


def test_stage3_built_in_configure_model_holds_one_unit_not_the_model():
    p = peak_estimate("zero3", N_PARAMS, 2, STEP, batch=1, eager=False)
    assert p.phases["import_build"] == 300 * MIB + 4 * 1_000_000


def test_disk_offload_keeps_only_its_resident_subgroups_and_steps_a_group_at_a_time():
    from lightning_zero.config import OffloadConfig

    offload = OffloadConfig(offload_subgroup_mb=1.0)
    p = peak_estimate("zero3_offload_disk", N_PARAMS, 2, STEP, batch=1, bucket_mb=1.0, offload=offload)
    # No host budget known: three sub-groups of masters, their moments, parameter rows and gradient shards (a host
    # run keeps them in files, read with their sub-group), in memory during the update only (freed between steps):
    # the update's workspace, beside a bucket's; nothing of the states is held through the backward.
    assert p.terms["states"] == 0
    assert p.terms["workspace"] == MIB + 3 * 2**20 * (12 + 4 + 4) // 4


def test_on_cuda_the_peak_is_the_devices_without_the_process_baseline():
    p = peak_estimate("zero1_offload", N_PARAMS, 2, STEP, batch=1, shared_host=False)
    assert p.terms["baseline"] == 0 and p.terms["workspace"] == 0
    assert p.terms["states"] == 4 * N_PARAMS + 4 * N_PARAMS  # the working parameters and the full gradients


def test_recommend_from_the_measured_peak_shards_more_than_from_the_model_states():
    budget = estimate.Budget(300 * MIB + 33 * N_PARAMS // 2, host=10**12, disk=10**12, shared_host=True)
    assert estimate.recommend(N_PARAMS, 2, budget, bucket_mb=1.0).choice == "ddp"  # 16Ψ of model states fit
    chosen = estimate.recommend(N_PARAMS, 2, budget, bucket_mb=1.0, peak=PeakInputs(STEP, batch=2))
    # The peaks above the baseline: ddp 23.1Ψ, zero1 17.3Ψ, zero2 15.3Ψ (activations, buckets and the Adam
    # workspace besides the model states) against 16.5Ψ: only zero2 fits.
    assert chosen.choice == "zero2"
    e = next(e for e in chosen.estimates if e.option == "zero2")
    assert e.device + e.host_total == peak_estimate("zero2", N_PARAMS, 2, STEP, 2, bucket_mb=1.0).peak


def test_hybrid_communication_spans_flat_sharding_and_ddp():
    from lightning_zero.estimate import communication_bytes, hybrid_communication_bytes

    psi = 1_000_000
    # one group of every rank: flat ZeRO, nothing across groups
    assert hybrid_communication_bytes("zero3", psi, 8, 8, 2) == (communication_bytes("zero3", psi, 8, 2), 0)
    # groups of one: nothing to shard, and the all-reduce across the 8 replicas is DDP's
    assert hybrid_communication_bytes("zero2", psi, 8, 1, 2) == (0, communication_bytes("ddp", psi, 8, 2))
    # 2 nodes x 4: a rank all-reduces its quarter of the gradients with its one peer on the other node
    assert hybrid_communication_bytes("zero1", psi, 8, 4, 2)[1] == 2 * (psi // 4) * 2 // 2
    with pytest.raises(EstimateError, match="shard_group_size=3 is invalid for 8 ranks"):
        hybrid_communication_bytes("zero3", psi, 8, 3, 2)


def test_hpz_secondary_shards_are_psi_b_over_k2():
    from lightning_zero.estimate import hpz_bytes

    assert hpz_bytes(1_000_000, "32-true", 8) == 500_000  # 4 bytes x 1M / 8
    assert hpz_bytes(1_000_001, "bf16-mixed", 8) == 2 * 125_001  # the largest slice, rounded up
    assert hpz_bytes(1_000_000, "16-mixed", 1) == 2_000_000  # a group of one keeps the whole unit
    with pytest.raises(EstimateError, match=r"^hpz_group_size=0 is invalid: it must be an integer >= 1"):
        hpz_bytes(1_000, "32-true", 0)


def test_peak_of_a_zero3_step_with_hpz_adds_the_units_secondary_shards():
    plain = peak_estimate("zero3", N_PARAMS, 4, STEP, batch=3, bucket_mb=1.0)
    hpz = peak_estimate("zero3", N_PARAMS, 4, STEP, batch=3, bucket_mb=1.0, hpz_group_size=2)
    secondaries = 4 * (N_PARAMS - 250_000) // 2  # every unit's elements but the root unit's, fp32, over K2
    assert hpz.terms["secondaries"] == secondaries and "secondaries" not in plain.terms
    assert hpz.phases["steady_step"] == plain.phases["steady_step"] + secondaries
    assert hpz.phases["setup"] == plain.phases["setup"]  # transient: from a forward to its backward only
    assert peak_estimate("zero2", N_PARAMS, 4, STEP, batch=3, hpz_group_size=2).terms["secondaries"] == 0


@pytest.mark.parametrize("option", ["zero3_offload", "zero3_offload_params", "zero3_offload_disk"])
@pytest.mark.parametrize("shared_host", [True, False])
def test_peak_with_offload_and_hpz_adds_the_same_secondary_shards(option: str, shared_host: bool):
    """hpZ's secondaries are slices of the gathered units, on the training device whatever offload keeps on the host
    or disk: the same term as in-device zero3's, added to every offloaded layout's step (and, on a GPU, to the
    device's share, which offload otherwise lowers)."""
    in_device = peak_estimate("zero3", N_PARAMS, 4, STEP, batch=3, bucket_mb=1.0, hpz_group_size=2)
    plain = peak_estimate(option, N_PARAMS, 4, STEP, batch=3, bucket_mb=1.0, shared_host=shared_host)
    hpz = peak_estimate(option, N_PARAMS, 4, STEP, batch=3, bucket_mb=1.0, shared_host=shared_host, hpz_group_size=2)
    assert hpz.terms["secondaries"] == in_device.terms["secondaries"] > 0
    assert hpz.phases["steady_step"] == plain.phases["steady_step"] + hpz.terms["secondaries"]
    assert hpz.phases["setup"] == plain.phases["setup"]


def test_quantized_reduce_bytes_are_the_payloads_of_a_segment():
    from lightning_zero.estimate import quantized_reduce_bytes

    psi = 1_000_000
    segment = psi // 8  # 125000 elements a rank: 31 blocks of 4096 (the last partial)
    int4, int8 = -(-(segment // 2 + 4 * 31) // 4) * 4, segment + 4 * 31
    # 2 nodes x 4: three peers in the node get both nodes' segments as int8, the one peer across gets the partial sum
    # in the format asked for
    assert quantized_reduce_bytes(psi, 8, 4, 4) == (3 * 2 * int8, int4)
    assert quantized_reduce_bytes(psi, 8, 4, 8) == (3 * 2 * int8, int8)
    assert quantized_reduce_bytes(psi, 8, 8, 4) == (7 * int8, 0)  # one node: nothing crosses
    assert 0.125 < int4 / (4 * segment) < 0.126  # about 1/8 of fp32's bytes across
    with pytest.raises(EstimateError, match="node_size=3 is invalid for 8 ranks"):
        quantized_reduce_bytes(psi, 8, 3, 4)
