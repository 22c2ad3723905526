"""Sweeps: parameter parsing, grid expansion, CSV, plots, local pools and a Dask LocalCluster."""

from __future__ import annotations

import csv
import io
import os

import pytest
from test_report_helpers import FakeConfig, fake_run

from kvflow.reports import sweep as S
from kvflow.reports import sweep_plots as SP
from kvflow.reports.render import METRICS

BASE = FakeConfig(trace="/data/t.jsonl")
GRID = ["host_blocks=0,1000,4000", "eviction=lru,s3fifo"]


def params(*specs: str) -> list[S.Param]:
    return S.parse_params(FakeConfig, list(specs))


# -- parsing ----------------------------------------------------------------------------


def test_parse_typed_values() -> None:
    got = params(
        "host_blocks=0,1_000,4e3",
        "eviction=lru,s3fifo",
        "limit=none,50",
        "sample_interval_s=2.5",
        "skip_bad=true,no",
        "trace=a.jsonl",
    )
    assert got == [
        ("host_blocks", [0, 1000, 4000]),
        ("eviction", ["lru", "s3fifo"]),
        ("limit", [None, 50]),
        ("sample_interval_s", [2.5]),
        ("skip_bad", [True, False]),
        ("trace", ["a.jsonl"]),
    ]
    assert all(type(v) is int for v in got[0][1])


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("host_blocks", "expected NAME=V1,V2"),
        ("=1,2", "expected NAME=V1,V2"),
        ("host_blocks=", "empty value"),
        ("host_blocks=1,,2", "empty value"),
        ("hots_blocks=1", "unknown parameter 'hots_blocks'; valid: trace, model, profile"),
        ("host_blocks=1k", "host_blocks=1k: expected an integer"),
        ("host_blocks=1.5", "expected an integer"),
        ("host_blocks=-1", "host_blocks=-1: must be >= 0"),
        ("seed=none", "seed=none: expected an integer"),
        ("eviction=lru,mru", "eviction=mru: unknown value; valid: lru, lfu, s3fifo, arc"),
        ("write_policy=back", "valid: write_through, write_through_selective, write_back"),
        ("mode=fast", "mode=fast: unknown value; valid: full, cache"),
        ("sample_interval_s=0", "must be > 0"),
        ("sample_interval_s=nan", "expected a finite number"),
        ("skip_bad=maybe", "expected true or false"),
        ("eviction=lru,lru", "eviction: value 'lru' given twice"),
    ],
)
def test_parse_errors(spec: str, words: str) -> None:
    with pytest.raises(S.SweepError) as exc:
        params(spec)
    assert words in str(exc.value)


def test_param_given_twice() -> None:
    with pytest.raises(S.SweepError, match="'eviction' given twice"):
        params("eviction=lru", "eviction=lfu")


# -- expansion --------------------------------------------------------------------------


def test_expand_grid_order_and_configs() -> None:
    points = S.expand_grid(BASE, params(*GRID, "mode=cache"))
    assert len(points) == 6
    assert [(p.params["host_blocks"], p.params["eviction"]) for p in points] == [
        (0, "lru"),
        (0, "s3fifo"),
        (1000, "lru"),
        (1000, "s3fifo"),
        (4000, "lru"),
        (4000, "s3fifo"),
    ]
    assert [p.index for p in points] == list(range(6))
    cfg = points[3].config
    assert (cfg.host_blocks, cfg.eviction, cfg.mode, cfg.trace) == (
        1000,
        "s3fifo",
        "cache",
        "/data/t.jsonl",
    )
    assert BASE.host_blocks is None  # the base is not touched
    assert points[3].label == "host_blocks=1000, eviction=s3fifo, mode=cache"


def test_expand_grid_reports_a_rejected_combination_before_running() -> None:
    with pytest.raises(S.SweepError, match=r"point host_blocks=0, limit=13: limit 13 is unlucky"):
        S.expand_grid(BASE, params("host_blocks=0", "limit=5,13"))


# -- running ----------------------------------------------------------------------------


def test_run_grid_serial_records_failures_and_progress() -> None:
    seen: list[tuple[int, int, str]] = []
    results = S.run_grid(
        BASE,
        params("host_blocks=0,666,4000"),
        fake_run,
        workers=1,
        progress=lambda d, n, r: seen.append((d, n, r.point.label)),
    )
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].report is None and results[1].error == "host tier of the beast"
    assert results[2].report["hit_rate"]["host"] == pytest.approx(0.3 * 4000 / 6000, abs=1e-6)
    assert seen == [(1, 3, "host_blocks=0"), (2, 3, "host_blocks=666"), (3, 3, "host_blocks=4000")]
    assert results[0].report["pid"] == os.getpid()  # workers=1: in this process


def test_run_grid_process_pool() -> None:
    done: list[int] = []
    results = S.run_grid(
        BASE, params(*GRID), fake_run, workers=2, progress=lambda d, n, r: done.append(d)
    )
    assert sorted(done) == list(range(1, 7))
    assert [r.point.index for r in results] == list(range(6))  # grid order, whatever finished first
    assert all(r.ok for r in results)
    assert os.getpid() not in {r.report["pid"] for r in results}  # in worker processes
    for r in results:  # each point ran with its own config
        assert r.report["config"]["host_blocks"] == r.point.params["host_blocks"]
        assert r.report["config"]["eviction"] == r.point.params["eviction"]


def test_run_grid_rejects_bad_workers_and_missing_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(S.SweepError, match="workers must be >= 1"):
        S.run_grid(BASE, params("seed=1"), fake_run, workers=0)

    def broken() -> S.RunFn:
        raise S.SweepError("the replay engine is not available (test)")

    monkeypatch.setattr(S, "_default_run", broken)
    with pytest.raises(S.SweepError, match="not available"):
        S.run_grid(BASE, params("seed=1"))


def test_dask_local_cluster() -> None:
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None
        ) as cluster,
    ):
        done: list[int] = []
        results = S.run_grid(
            BASE,
            params("host_blocks=0,666,1000", "eviction=lru,lfu"),
            fake_run,
            scheduler=cluster.scheduler_address,
            progress=lambda d, n, r: done.append(d),
        )
    assert sorted(done) == list(range(1, 7))
    assert [r.point.index for r in results] == list(range(6))
    assert [r.ok for r in results] == [True, True, False, False, True, True]
    assert results[2].error == "host tier of the beast"
    assert results[5].report["config"]["eviction"] == "lfu"
    local = S.run_grid(
        BASE, params("host_blocks=0,666,1000", "eviction=lru,lfu"), fake_run, workers=1
    )
    assert SP.csv_text(results, ["host_blocks", "eviction"]) == SP.csv_text(
        local, ["host_blocks", "eviction"]
    )


def test_dask_unreachable_scheduler_is_one_clear_error() -> None:
    pytest.importorskip("distributed")
    # returning at all is the bound (connect_timeout_s); the one clear error the behaviour
    with pytest.raises(S.SweepError, match=r"cannot reach the Dask scheduler at tcp://127.0.0.1:1"):
        S.run_grid(
            BASE, params("seed=1"), fake_run, scheduler="tcp://127.0.0.1:1", connect_timeout_s=2
        )
    with pytest.raises(S.SweepError, match="bad Dask scheduler address 'nohost'"):
        S.run_grid(BASE, params("seed=1"), fake_run, scheduler="nohost")


# -- output -----------------------------------------------------------------------------


def test_csv_rows_and_columns() -> None:
    ps = params("host_blocks=0,666,4000", "eviction=lru,s3fifo", "limit=none")
    results = S.run_grid(BASE, ps, fake_run, workers=1)
    rows = list(csv.DictReader(io.StringIO(SP.csv_text(results, [n for n, _ in ps]))))
    header = SP.csv_header([n for n, _ in ps])
    assert header[:4] == ["point", "host_blocks", "eviction", "limit"] and header[-1] == "error"
    assert header[4:-1] == [m.key for m in METRICS]
    assert len(rows) == 6
    assert [(r["point"], r["host_blocks"], r["eviction"], r["limit"]) for r in rows[:2]] == [
        ("0", "0", "lru", ""),
        ("1", "0", "s3fifo", ""),
    ]
    for r, res in zip(rows, results, strict=True):
        if res.ok:
            assert r["error"] == ""
            assert float(r["hit_rate.total"]) == res.report["hit_rate"]["total"]
            assert float(r["ttft_s.p99"]) == res.report["ttft_s"]["p99"]
            assert r["errors.replans"] == ""  # not in this report
        else:
            assert r["error"] == "host tier of the beast" and r["hit_rate.total"] == ""


def test_choose_x() -> None:
    assert SP.choose_x(params("eviction=lru,lfu", "seed=1,2", "host_blocks=0,10")) == "host_blocks"
    assert SP.choose_x(params("eviction=lru,lfu", "seed=1,2")) == "seed"
    assert SP.choose_x(params("eviction=lru,lfu", "host_blocks=5")) == "eviction"
    assert SP.choose_x(params("host_blocks=5")) is None
    assert SP.choose_x(params("host_blocks=0,5", "seed=1,2"), "seed") == "seed"
    with pytest.raises(S.SweepError, match="--x model: not a swept parameter"):
        SP.choose_x(params("host_blocks=0,5"), "model")


def test_sweep_plots() -> None:
    ps = params("host_blocks=0,1000,4000", "eviction=lru,s3fifo")
    plots = SP.sweep_plots(S.run_grid(BASE, ps, fake_run, workers=1), ps)
    assert list(plots) == ["hit_rate", "ttft"]
    assert all(p.startswith(b"\x89PNG") for p in plots.values())
    cache = params("host_blocks=0,1000", "mode=cache")
    assert list(SP.sweep_plots(S.run_grid(BASE, cache, fake_run, workers=1), cache)) == ["hit_rate"]
    one = params("host_blocks=1000")
    assert SP.sweep_plots(S.run_grid(BASE, one, fake_run, workers=1), one) == {}
