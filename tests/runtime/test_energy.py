"""Energy per answer (runtime/board/energy.py, engine/step_energy.energy_shares) and the throttling flag
(runtime/board.read_throttling), on copies of the fixture board trees whose power values change while
the meter runs; the last tests run the real engine and a real node on the bundled model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from edgellm.api.metrics import ServiceMetrics
from edgellm.engine.step_plan import StepPlan
from edgellm.runtime.board.energy import EnergyMeter, power_sources
from edgellm.runtime.board.telemetry import BoardTelemetry
from edgellm.runtime.board.throttling import read_throttling
from tests.nodeproc import wait_until
from tests.runtime.test_board import board_copy

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "board"
ORIN_HWMON = "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1"
XAVIER_IIO = "sys/bus/i2c/drivers/ina3221x/7-0040/iio:device0"
ORIN_GPU = "sys/class/devfreq/17000000.ga10b"
THERMAL = "sys/devices/virtual/thermal"


def put(path: Path, text: str) -> None:
    """Write as sysfs changes a value: the reader sees the old text or the new, never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def set_vdd_in(root: Path, watts: float) -> None:
    """VDD_IN at 5.000 V and the current that gives `watts` (hwmon: mV x mA / 1000 = mW)."""
    put(root / ORIN_HWMON / "in1_input", "5000\n")
    put(root / ORIN_HWMON / "curr1_input", f"{round(watts * 200)}\n")


class StepClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def trapezoid(samples: list[tuple[float, float]]) -> float:
    return sum((w0 + w1) / 2 * (t1 - t0) for (t0, w0), (t1, w1) in zip(samples, samples[1:], strict=False))


# -- which power ---------------------------------------------------------------------------------
def test_the_total_rail_is_used_where_the_board_has_one(tmp_path: Path) -> None:
    rail, sources = power_sources(FIXTURES / "orin")
    assert rail == "VDD_IN" and [s.label for s in sources] == ["VDD_IN"]
    assert EnergyMeter(FIXTURES / "orin").read_watts() == pytest.approx(5.36448)
    # Xavier NX (the IIO driver): its VDD_IN from the driver's own power file.
    assert EnergyMeter(FIXTURES / "xavier").read_watts() == pytest.approx(5.868)


def test_without_a_total_rail_the_rails_are_summed(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    put(root / ORIN_HWMON / "in1_label", "VDD_GPU_SOC\n")  # as on AGX Orin: no VDD_IN
    meter = EnergyMeter(root)
    assert meter.rail == "VDD_GPU_SOC+VDD_CPU_GPU_CV+VDD_SOC"
    assert meter.read_watts() == pytest.approx((5364.48 + 934.72 + 1503.68) / 1000)


def test_no_rails_no_meter_and_no_energy_series(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    shutil.rmtree(root / "sys/bus")
    meter = EnergyMeter(root).start()
    assert not meter.available and meter._thread is None and meter.watts() is None
    metrics = ServiceMetrics(live=lambda: {"in_flight": 0, "max_queued": 1})
    metrics.finished("completed", prompt_tokens=3, completion_tokens=5, timings={"ttft_ms": 1.0, "decode_ms": 2.0})
    assert b"energy" not in metrics.prometheus_text() and "energy" not in metrics.as_dict()


# -- integration -----------------------------------------------------------------------------------
def test_trapezoid_over_samples_and_between_them(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    clock = StepClock()
    meter = EnergyMeter(root, clock=clock)
    set_vdd_in(root, 5.0)
    meter.sample()
    clock.now += 1.0
    meter.sample()
    assert meter.joules() == pytest.approx(5.0)
    set_vdd_in(root, 10.0)
    clock.now += 0.5
    meter.sample()  # 0.5 s from 5 W to 10 W: 3.75 J
    assert meter.joules() == pytest.approx(8.75)
    clock.now += 0.2  # between samples: the last power held, 10 W x 0.2 s
    assert meter.joules() == pytest.approx(10.75)
    set_vdd_in(root, 2.0)
    clock.now += 0.3
    meter.sample()  # the trapezoid gives 8.75 + 0.5 x 6 W = 11.75 J: ahead of the 10.75 answered, fine
    assert meter.joules() == pytest.approx(11.75 + 0.0)
    clock.now += 1.0
    meter.sample()  # 2 W for 1 s
    assert meter.joules() == pytest.approx(13.75)


def test_answers_never_go_down_when_the_power_falls(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    clock = StepClock()
    meter = EnergyMeter(root, clock=clock)
    set_vdd_in(root, 10.0)
    meter.sample()
    clock.now += 1.0
    held = meter.joules()  # 10 J: 10 W held for 1 s
    set_vdd_in(root, 0.0)
    meter.sample()  # the trapezoid says 5 J
    assert meter.joules() == held == pytest.approx(10.0)
    set_vdd_in(root, 10.0)
    clock.now += 1.0
    meter.sample()  # 5 + 5 = 10 J: the integral has caught up
    clock.now += 0.5
    assert meter.joules() == pytest.approx(15.0)


def test_an_unreadable_sample_is_skipped_not_zeroed(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    clock = StepClock()
    meter = EnergyMeter(root, clock=clock)
    set_vdd_in(root, 4.0)
    meter.sample()
    (root / ORIN_HWMON / "curr1_input").unlink()
    clock.now += 0.5
    assert meter.sample() is None and meter.missed == 1
    set_vdd_in(root, 4.0)
    clock.now += 0.5
    meter.sample()
    assert meter.joules() == pytest.approx(4.0)  # the gap bridged by a straight line


def test_the_meter_thread_integrates_power_that_changes_while_it_runs(tmp_path: Path) -> None:
    """5 W for 10 samples or more, then 10 W for 5 samples or more, written while the thread samples at
    50 Hz: the counter is the trapezoid of the samples it took, each sample reads a value that was
    written, and the 5 W stretch gives 5 J per second of sample time (tolerances from the sample
    times, no assumption on speed)."""
    root = board_copy(tmp_path, "orin")
    set_vdd_in(root, 5.0)
    meter = EnergyMeter(root, interval_s=0.02, history=10_000).start()
    try:
        wait_until(lambda: meter.samples >= 10, 30, "10 samples at 5 W")
        set_vdd_in(root, 10.0)
        wait_until(lambda: meter.watts() == 10.0, 30, "a sample at 10 W")
        at_ten = meter.samples
        wait_until(lambda: meter.samples >= at_ten + 4, 30, "5 samples at 10 W")
    finally:
        meter.stop()
    samples = list(meter.history)
    assert len(samples) == meter.samples >= 15  # every sample kept
    watts = {round(w, 6) for _t, w in samples}
    assert watts == {5.0, 10.0}
    assert [w for _t, w in samples] == sorted(w for _t, w in samples)  # 5 W until the change, 10 W after
    assert meter.joules() >= trapezoid(samples) - 1e-9
    assert meter._joules == pytest.approx(trapezoid(samples), rel=1e-12)
    five = [(t, w) for t, w in samples if w == pytest.approx(5.0)]
    span = five[-1][0] - five[0][0]
    assert trapezoid(five) == pytest.approx(5.0 * span, rel=1e-9)
    # The whole run lies between all-5 W and all-10 W over the sampled time.
    total_span = samples[-1][0] - samples[0][0]
    assert 5.0 * total_span - 1e-9 <= trapezoid(samples) <= 10.0 * total_span + 1e-9
    cost = meter.cost_per_sample_us()
    assert cost is not None and cost > 0
    print(f"energy meter: {meter.samples} samples, {cost:.1f} us per sample")


# -- attribution -----------------------------------------------------------------------------------
def test_a_steps_energy_is_shared_by_the_tokens_each_sequence_fed() -> None:
    # seq 0 prefills 6 prompt tokens, seq 3 decodes 1 token and verifies 1 draft, seq 5 decodes 1.
    plan = StepPlan(seq_ids=[3, 3, 5, 0, 0, 0, 0, 0, 0])
    shares = energy_shares_of(0.9, plan)
    assert shares == pytest.approx({0: 0.6, 3: 0.2, 5: 0.1})
    assert sum(shares.values()) == pytest.approx(0.9)
    assert energy_shares_of(0.0, plan) == {} and energy_shares_of(1.0, StepPlan()) == {}


def energy_shares_of(spent: float, plan: StepPlan) -> dict[int, float]:
    from edgellm.engine.step_energy import energy_shares  # the engine module (llama.cpp bindings) only here

    return energy_shares(spent, plan)


def test_the_engine_charges_every_step_to_its_requests(model_path) -> None:
    """The real scheduler with an energy source that gains 1 J per reading: each decoded step charges
    exactly 1 J, so the requests' energy adds up to the steps decoded while they ran (nothing lost or
    counted twice), a request alone gets every step it was in, and joules_per_token is energy / tokens."""
    from edgellm.engine.core import EngineCore
    from edgellm.engine.model import ModelConfig
    from edgellm.engine.types import EngineRequest, SamplingParams

    readings = iter(range(1, 10**9))
    core = EngineCore(ModelConfig(path=model_path, n_ctx=2048, n_slots=4), max_waiting=8)
    try:
        core.set_energy(lambda: float(next(readings)))

        def run(requests: list[EngineRequest]) -> tuple[dict, int]:
            steps = core.scheduler.stats.steps
            outs: dict = {}
            for r in requests:
                assert core.add(r) is None
            core.run_until_idle(on_output=lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
            return outs, core.scheduler.stats.steps - steps

        def ask(rid: str, content: str, max_tokens: int) -> EngineRequest:
            sampling = SamplingParams(temperature=0, max_tokens=max_tokens)
            return EngineRequest(rid, [{"role": "user", "content": content}], sampling, cache_lookup=False)

        alone, steps = run([ask("alone", "Say hello.", 12)])
        t = alone["alone"].timings
        assert t["energy_j"] == pytest.approx(steps)  # every step of the run was this request's
        assert t["joules_per_token"] == pytest.approx(t["energy_j"] / alone["alone"].completion_tokens)

        long_prompt = "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 30
        outs, steps = run([ask("long", long_prompt, 16), ask("short", "Count to five.", 16)])
        energy = {rid: out.timings["energy_j"] for rid, out in outs.items()}
        assert sum(energy.values()) == pytest.approx(steps)
        assert all(j > 0 for j in energy.values()) and set(energy) == {"long", "short"}

        core.set_energy(None)  # no power monitor: no energy fields at all
        plain, _ = run([ask("plain", "Say hello.", 8)])
        assert "energy_j" not in plain["plain"].timings and "joules_per_token" not in plain["plain"].timings
    finally:
        core.close()


# -- throttling --------------------------------------------------------------------------------------
def add_passive_trip(root: Path, zone: int, milli_c: int) -> None:
    put(root / THERMAL / f"thermal_zone{zone}/trip_point_0_type", "passive\n")
    put(root / THERMAL / f"thermal_zone{zone}/trip_point_0_temp", f"{milli_c}\n")
    put(root / THERMAL / f"thermal_zone{zone}/trip_point_1_type", "critical\n")
    put(root / THERMAL / f"thermal_zone{zone}/trip_point_1_temp", "105000\n")


def add_cpu(root: Path, n: int, cur_khz: int, max_khz: int) -> None:
    put(root / f"sys/devices/system/cpu/cpu{n}/cpufreq/scaling_cur_freq", f"{cur_khz}\n")
    put(root / f"sys/devices/system/cpu/cpu{n}/cpufreq/cpuinfo_max_freq", f"{max_khz}\n")


def test_throttling_is_undecided_without_trip_points() -> None:
    # The shared fixture has clocks but no trip points: nothing is claimed either way.
    assert read_throttling(FIXTURES / "orin") == {}
    assert BoardTelemetry(FIXTURES / "orin").health() == {"power_mode": {"id": 0, "name": "15W"}}


def test_hot_with_the_gpu_below_its_max_is_throttled(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    add_passive_trip(root, 1, 45000)  # gpu-thermal reads 46.843 C
    add_passive_trip(root, 0, 95000)  # cpu-thermal is far from its trip point
    assert read_throttling(root) == {"throttled": True, "hot_zones": ["gpu-thermal"], "below_max": ["gpu"]}
    health = BoardTelemetry(root).health()
    assert health["throttled"] is True and health["power_mode"] == {"id": 0, "name": "15W"}


def test_hot_with_every_clock_at_its_max_is_not_throttled(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    add_passive_trip(root, 1, 45000)
    put(root / ORIN_GPU / "cur_freq", "624750000\n")
    add_cpu(root, 0, 1510400, 1510400)
    assert read_throttling(root) == {"throttled": False, "hot_zones": ["gpu-thermal"], "below_max": []}


def test_a_cpu_below_its_max_on_a_hot_board_is_throttled(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    add_passive_trip(root, 0, 48000)  # cpu-thermal at 48.156 C, just past it
    put(root / ORIN_GPU / "cur_freq", "624750000\n")
    add_cpu(root, 0, 1510400, 1510400)
    add_cpu(root, 1, 729600, 1510400)
    assert read_throttling(root) == {"throttled": True, "hot_zones": ["cpu-thermal"], "below_max": ["cpu1"]}


def test_a_cool_board_with_low_clocks_is_not_throttled(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    add_passive_trip(root, 1, 99000)
    add_cpu(root, 0, 729600, 1510400)  # the governor idles it: not throttling
    assert read_throttling(root) == {"throttled": False, "hot_zones": [], "below_max": ["gpu", "cpu0"]}


# -- the node ------------------------------------------------------------------------------------------
def test_the_node_reports_energy_per_answer_and_throttling(tmp_path: Path) -> None:
    """A real node on a copy of the Orin fixture (VDD_IN rewritten to 6 W, a passive trip point crossed):
    a chat answer carries energy_j > 0 and joules_per_token, /metrics the energy series, /health and
    /status the power mode and the throttling flag."""
    from tests.conftest import chat
    from tests.nodeproc import NodeProcess

    root = board_copy(tmp_path, "orin")
    set_vdd_in(root, 6.0)
    add_passive_trip(root, 1, 45000)
    node = NodeProcess(tmp_path / "state", env={"EDGELLM_BOARD_ROOT": str(root)}).start()
    try:
        with node.client() as c:
            body = c.post("/create_chat_completion", json=chat("Name three colors.", max_tokens=24)).json()
            timings = body["result"]["FULL_OUTPUT"][0]["timings"]
            usage = body["result"]["FULL_OUTPUT"][0]["usage"]
            prom = c.get("/metrics", params={"format": "prometheus"}).text
            health = c.get("/health").json()["result"]
            status = c.get("/status").json()["result"]
            metrics = c.get("/metrics").json()["result"]
            # The hot board sheds its lowest lane first: batch work waits, the others go on.
            paused = c.post("/predict", json=chat("Name three colors.", max_tokens=16, priority="batch"))
            realtime = c.post("/predict", json=chat("Name three colors.", max_tokens=16, priority="realtime"))
    finally:
        node.stop()
    assert paused.status_code == 503 and paused.headers["Retry-After"] == "30", paused.text
    assert "thermally throttled (gpu-thermal" in paused.json()["result"]["error"]
    assert realtime.status_code == 200, realtime.text
    assert health["lanes"]["batch"]["open"] is False and "thermally throttled" in health["lanes"]["batch"]["reason"]
    assert health["lanes"]["interactive"] == health["lanes"]["realtime"] == {"open": True}
    print(f"node on the Orin fixture at 6 W: timings {timings}, usage {usage}, /metrics energy {metrics['energy']}")
    assert timings["energy_j"] > 0
    assert timings["joules_per_token"] == pytest.approx(timings["energy_j"] / usage["completion_tokens"], abs=2e-3)
    # No more than 6 W over the request's time in the engine (queue to last token), with a sample's slack.
    engine_s = (timings["ttft_ms"] - timings["queue_ms"] + timings["decode_ms"]) / 1000
    assert timings["energy_j"] <= 6.0 * (engine_s + 0.2)
    assert "edgellm_energy_joules_total " in prom
    assert "edgellm_request_energy_joules_total " in prom and "edgellm_energy_joules_per_token " in prom
    assert metrics["energy"]["board_joules"] > 0 and metrics["energy"]["request_joules"] >= timings["energy_j"] - 1e-3
    assert health["board"] == {"power_mode": {"id": 0, "name": "15W"}, "throttled": True, "hot_zones": ["gpu-thermal"],
                     "below_max": ["gpu"]}  # fmt: skip
    assert status["board"]["throttled"] is True and status["board"]["power_mw"]["VDD_IN"] == pytest.approx(6000.0)
