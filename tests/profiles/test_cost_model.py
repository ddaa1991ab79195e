import pytest

from dualpace.profile.cost_model import CostModel, DecodeBatch, interp1d, interp2d
from dualpace.profile.files import parse_profile
from tests.profiles.tiny import tiny_profile_dict


def test_interp1d_inside_and_off_the_ends():
    grid, values = [1, 3, 5], [10.0, 20.0, 40.0]
    assert interp1d(grid, values, 1) == 10.0
    assert interp1d(grid, values, 2) == 15.0
    assert interp1d(grid, values, 4) == 30.0
    assert interp1d(grid, values, 7) == 60.0  # last segment's slope (10 per unit)
    assert interp1d(grid, values, 0) == 5.0  # first segment's slope
    assert interp1d(grid, values, -10) == 0.0  # clamped at 0
    assert interp1d([4], [7.0], 100) == 7.0


def test_interp2d_bilinear_and_extrapolation():
    g0, g1 = [0, 10], [0, 100]
    values = [[0.0, 10.0], [20.0, 40.0]]
    assert interp2d(g0, g1, values, 0, 0) == 0.0
    assert interp2d(g0, g1, values, 10, 100) == 40.0
    assert interp2d(g0, g1, values, 5, 50) == pytest.approx((0 + 10 + 20 + 40) / 4)
    assert interp2d(g0, g1, values, 20, 100) == pytest.approx(70.0)  # 10 -> 40 -> 70 along batch
    assert interp2d(g0, g1, values, 10, 200) == pytest.approx(60.0)  # 20 -> 40 -> 60 along context
    assert interp2d([1], [5], [[3.0]], 9, 9) == 3.0


@pytest.fixture
def model():
    return CostModel(parse_profile(tiny_profile_dict()))


def test_gpu_iteration(model):
    assert model.gpu_iteration_ms(0, DecodeBatch(0, 0)) == 0.0
    assert model.gpu_iteration_ms(51, DecodeBatch(0, 0)) == pytest.approx(15.0)
    assert model.gpu_iteration_ms(0, DecodeBatch(1, 50)) == pytest.approx(15.0)
    assert model.gpu_iteration_ms(0, DecodeBatch.of([40, 60])) == pytest.approx(16.5)  # batch 2 at context 50: 15 + 0.1 * (30 - 15)
    # mixed: max(prefill(50 + 1) = 15, decode(1, 0) = 10) + attention extra decode(1,100)-decode(1,0) = 10
    assert model.gpu_iteration_ms(50, DecodeBatch(1, 100)) == pytest.approx(25.0)


def test_cpu_iteration_local_and_assisted(model):
    decode = DecodeBatch.of([100])
    cost = model.cpu_iteration(decode)
    assert cost.local_ms == pytest.approx(30 + 10 + 5)
    assert cost.assisted_ms == pytest.approx(25 + 10)
    assert cost.best_ms == pytest.approx(35)
    assert cost.assisted_is_faster
    with_prefill = model.cpu_iteration(DecodeBatch(0, 0), num_prefill_tokens=11, num_sampled=1)
    assert with_prefill.assisted_ms is None
    assert with_prefill.local_ms == pytest.approx(40 + 0 + 5)


def test_cpu_itl_with_one_more(model):
    # batch 2 of mean context 50: local = 31 + 5.5 + 5 = 41.5, assisted = 25 + 5.5 = 30.5
    assert model.cpu_itl_with_one_more_ms([100], 0) == pytest.approx(30.5)
    assert model.cpu_itl_with_one_more_ms([100], 0, assist_available=False) == pytest.approx(41.5)


def test_kv_transfer(model):
    assert model.kv_bytes_per_token == 32
    assert model.kv_transfer_ms(0) == 2.0
    assert model.kv_transfer_ms(1000) == pytest.approx(2.0 + 1000.0)  # 32 kB at 32 kB/s


def _moe_profile(batch_grid, ms, num_experts=128, top_k=8):
    data = tiny_profile_dict()
    data["model"]["moe"] = {"num_experts": num_experts, "num_experts_per_tok": top_k, "dense_bytes": 1000,
                            "expert_bytes": 100, "num_sparse_layers": 2}
    data["tables"]["cpu_dense_ms"] = {"batch": batch_grid, "ms": ms}
    return parse_profile(data)


def test_moe_cpu_dense_cost_follows_the_experts_a_batch_selects():
    """With two grid points the fit is the line along the expected bytes read (distinct experts of
    B rows at top-8 of 128), not the batch: concave, so above the straight line of the batch."""
    profile = _moe_profile([1, 32], [10.0, 41.0])
    moe = profile.model.moe
    model = CostModel(profile)
    assert model.cpu_dense_ms(1) == pytest.approx(10.0) and model.cpu_dense_ms(32) == pytest.approx(41.0)
    share = (moe.step_bytes(8) - moe.step_bytes(1)) / (moe.step_bytes(32) - moe.step_bytes(1))
    assert model.cpu_dense_ms(8) == pytest.approx(10.0 + share * 31.0)
    assert model.cpu_dense_ms(8) > 10.0 + (8 - 1) / 31 * 31.0  # the straight line in the batch
    assert moe.active_bytes_per_token() == 1000 + 2 * 8 * 100
    assert moe.step_bytes(1) == pytest.approx(moe.active_bytes_per_token())
    share = (moe.step_bytes(64) - moe.step_bytes(1)) / (moe.step_bytes(32) - moe.step_bytes(1))
    assert model.cpu_dense_ms(64) == pytest.approx(10.0 + share * 31.0)  # off the grid: the same line


def test_moe_cpu_dense_cost_is_the_least_squares_fit_of_bytes_and_rows():
    """Over a grid of more points the CPU dense cost is const + a * bytes read + b * rows fitted by
    least squares: times made by such a law are recovered between and off the grid points, and a
    point off the law moves the fit towards it without passing through it."""
    grid = [1, 2, 4, 8, 16, 32, 64]
    moe = _moe_profile([1, 32], [10.0, 41.0]).model.moe

    def law(b):
        return 3.0 + 0.002 * moe.step_bytes(b) + 0.25 * b

    model = CostModel(_moe_profile(grid, [law(b) for b in grid]))
    for b in (3, 6, 12, 24, 48, 128):
        assert model.cpu_dense_ms(b) == pytest.approx(law(b))
    noisy = [law(b) for b in grid]
    noisy[3] += 5.0
    fitted = CostModel(_moe_profile(grid, noisy)).cpu_dense_ms(8)
    assert law(8) < fitted < noisy[3]


def test_moe_fit_never_makes_reading_more_bytes_or_rows_cheaper():
    """Times that fall as the bytes grow (noise) drop the bytes from the fit: the cost per row
    stays, and a larger batch never costs less."""
    grid = [1, 2, 4, 8, 16, 32, 64]
    fit = CostModel(_moe_profile(grid, [20.0, 19.0, 18.0, 30.0, 50.0, 90.0, 170.0])).moe_step_fit
    assert fit.ms_per_byte == 0.0 and fit.ms_per_row > 0.0
    costs = [fit.ms(b) for b in range(1, 129)]
    assert costs == sorted(costs)


def test_moe_cost_where_every_expert_is_selected_falls_back_to_the_batch():
    """Once a batch selects every expert the bytes stop growing; the cost still follows compute."""
    model = CostModel(_moe_profile([128, 256], [100.0, 180.0], num_experts=4, top_k=2))
    assert model.cpu_dense_ms(192) == pytest.approx(140.0)


def test_moe_fingerprint_round_trips_and_is_not_compared():
    from dataclasses import replace

    from dualpace.profile.files import profile_to_dict
    from dualpace.profile.schema import ProfileError, fingerprint_mismatches

    profile = _moe_profile([1, 32], [10.0, 41.0])
    assert parse_profile(profile_to_dict(profile)) == profile
    assert fingerprint_mismatches(profile, model=replace(profile.model, moe=None)) == []
    bad = profile_to_dict(profile)
    bad["model"]["moe"]["num_experts_per_tok"] = 200
    with pytest.raises(ProfileError, match="num_experts_per_tok"):
        parse_profile(bad)
