"""Distribution strings, per-rank lags and skew, the workload generators and the
shipped sample traces."""
import math
from pathlib import Path

import numpy as np
import pytest

from sim.dists import parse_dist, parse_rank_dists, parse_skew
from sim.errors import SimInputError
from sim.workload import load_trace, synthetic

DATA = Path(__file__).resolve().parents[2] / "sim" / "data"


@pytest.mark.parametrize("text,mean", [("const:2", 2.0), ("exp:1.5", 1.5), ("uniform:1,3", 2.0),
                                       ("lognormal:0,0.5", math.exp(0.125)),
                                       ("pareto:3,2", 3.0), ("gamma:2,4", 4.0)])
def test_distributions_draw_with_their_mean(text, mean):
    d = parse_dist(text, "--x")
    x = d.draw(np.random.default_rng(0), 200_000)
    assert d.mean == pytest.approx(mean)
    assert x.mean() == pytest.approx(mean, rel=0.03) and (x >= 0).all()


def test_empirical_draws_only_file_values():
    d = parse_dist(f"empirical:{DATA / 'lag_sample.txt'}", "--metadata-lag")
    assert len(d.sample) == 500
    x = d.draw(np.random.default_rng(1), 1000)
    assert set(x.tolist()) <= set(d.sample)


@pytest.mark.parametrize("text", ["", "exp", "exp:", "exp:0", "const:-1", "uniform:3,1",
                                  "pareto:0,1", "lognormal:1", "weird:1", "exp:nan", "exp:1,2",
                                  "empirical:"])
def test_invalid_strings_name_the_flag(text):
    with pytest.raises(SimInputError, match="^--metadata-lag: "):
        parse_dist(text, "--metadata-lag")


def test_empirical_file_errors_name_the_line(tmp_path):
    f = tmp_path / "lags.txt"
    f.write_text("0.5\n# note\n1.0\nfast\n")
    with pytest.raises(SimInputError, match="line 4"):
        parse_dist(f"empirical:{f}", "--metadata-lag")
    f.write_text("# only a comment\n")
    with pytest.raises(SimInputError, match="no values"):
        parse_dist(f"empirical:{f}", "--metadata-lag")


def test_per_rank_overrides_and_skew():
    dists = parse_rank_dists(["exp:1", "2=const:5"], 4, "--metadata-lag")
    assert [d.text for d in dists] == ["exp:1", "exp:1", "const:5", "exp:1"]
    assert parse_skew("2", 3) == [1.0, 2.0, 3.0]
    assert parse_skew("1,1,4", 3) == [1.0, 1.0, 4.0]
    with pytest.raises(SimInputError, match="--metadata-lag"):
        parse_rank_dists(["1=exp:1"], 4, "--metadata-lag")
    with pytest.raises(SimInputError, match="--lag-skew"):
        parse_skew("1,-1,1", 3)


def test_gamma_burstiness_keeps_the_rate_and_adds_variance():
    lens = parse_dist("const:100", "--input-len")
    poisson = synthetic(np.random.default_rng(0), 20_000, 10.0, 1.0, lens, lens)
    bursty = synthetic(np.random.default_rng(0), 20_000, 10.0, 0.25, lens, lens)
    for wl in (poisson, bursty):
        assert np.diff(wl.arrival_ms).mean() == pytest.approx(100.0, rel=0.05)
    cv = lambda wl: np.diff(wl.arrival_ms).std() / np.diff(wl.arrival_ms).mean()
    assert cv(poisson) == pytest.approx(1.0, rel=0.05)
    assert cv(bursty) == pytest.approx(2.0, rel=0.05)        # CV = 1 / sqrt(shape)


@pytest.mark.parametrize("rate,burst,flag", [(0, 1, "--rate"), (-1, 1, "--rate"), (1, 0, "--burstiness")])
def test_synthetic_rejects_bad_rates(rate, burst, flag):
    lens = parse_dist("const:1", "x")
    with pytest.raises(SimInputError, match=flag):
        synthetic(np.random.default_rng(0), 10, rate, burst, lens, lens)


def test_shipped_samples_load():
    moon = load_trace(str(DATA / "mooncake_sample.jsonl"))
    azure = load_trace(str(DATA / "azure_sample.csv"))
    for wl in (moon, azure):
        assert len(wl) == 200 and wl.arrival_ms[0] == 0.0
        assert (np.diff(wl.arrival_ms) >= 0).all() and (wl.input_len >= 1).all()
    assert load_trace(str(DATA / "mooncake_sample.jsonl"), 10).input_len.tolist() == moon.input_len[:10].tolist()
    assert len(load_trace(str(DATA / "azure_sample.csv"), 5)) == 5


def test_samples_are_what_the_generator_writes(tmp_path, monkeypatch):
    import sim.data.make_samples as mk
    monkeypatch.setattr(mk, "HERE", tmp_path)
    mk.main()
    for name in ("mooncake_sample.jsonl", "azure_sample.csv", "lag_sample.txt"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes()
