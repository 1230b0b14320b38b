"""Board telemetry from sysfs fixture trees (tests/fixtures/board/), laid out as on a real Orin Nano and Xavier NX."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edgellm.runtime.board.telemetry import BoardTelemetry, prometheus_samples

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "board"

ORIN = {
    "model": "NVIDIA Jetson Orin Nano Developer Kit",
    "gpu": {"load_percent": 28.7, "freq_mhz": 306.0, "min_freq_mhz": 306.0, "max_freq_mhz": 624.75},
    # cv0-thermal reads -256000 (fused-off sensor) and is left out.
    "temperatures_c": {"cpu-thermal": 48.156, "gpu-thermal": 46.843, "soc0-thermal": 46.218, "tj-thermal": 48.156},
    # hwmon: mV * mA / 1000
    "power_mw": {"VDD_IN": 5364.48, "VDD_CPU_GPU_CV": 934.72, "VDD_SOC": 1503.68},
    "power_mode": {"id": 0, "name": "15W"},
}

XAVIER = {
    "model": "NVIDIA Jetson Xavier NX Developer Kit",
    "gpu": {"load_percent": 51.2, "freq_mhz": 828.75, "min_freq_mhz": 114.75, "max_freq_mhz": 1109.25},
    # PMIC-Die (a constant 100 C stub) is left out.
    "temperatures_c": {
        "BCPU-therm": 41.5,
        "MCPU-therm": 41.5,
        "GPU-therm": 40.0,
        "PLL-therm": 39.5,
        "thermal-fan-est": 40.65,
    },
    # iio: the driver's own in_power{N}_input, not V * I
    "power_mw": {"VDD_IN": 5868.0, "VDD_CPU_GPU_CV": 2046.0, "VDD_SOC": 1524.0},
    "power_mode": {"id": 2, "name": "MODE_15W_6CORE"},
}

ORIN_HWMON = "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1"
XAVIER_IIO = "sys/bus/i2c/drivers/ina3221x/7-0040/iio:device0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def board_copy(tmp_path: Path, name: str) -> Path:
    """A writable copy of a fixture tree, for tests that break or change files."""
    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root)
    return root


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_orin_nano_fixture() -> None:
    assert BoardTelemetry(FIXTURES / "orin").read() == ORIN


def test_xavier_nx_fixture() -> None:
    assert BoardTelemetry(FIXTURES / "xavier").read() == XAVIER


def test_model_file_keeps_its_device_tree_nul() -> None:
    assert (FIXTURES / "orin/proc/device-tree/model").read_bytes().endswith(b"Kit\x00")


def test_empty_root_gives_empty_dict(tmp_path: Path) -> None:
    assert BoardTelemetry(tmp_path).read() == {}


def test_real_root_never_raises() -> None:
    assert isinstance(BoardTelemetry().read(), dict)


def test_garbled_and_missing_files_are_skipped(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    write(root / "sys/devices/virtual/thermal/thermal_zone0/temp", "abc\n")
    (root / "sys/devices/virtual/thermal/thermal_zone1/temp").unlink()
    (root / ORIN_HWMON / "curr2_input").unlink()
    write(root / ORIN_HWMON / "in3_input", "\xff garbage")
    write(root / "sys/devices/platform/gpu.0/load", "1234\n")  # beyond per-mille: not a load
    write(root / "sys/class/devfreq/17000000.ga10b/cur_freq", "")
    write(root / "var/lib/nvpmodel/status", "nonsense\n")

    data = BoardTelemetry(root).read()

    assert data == {
        "model": ORIN["model"],
        "gpu": {"min_freq_mhz": 306.0, "max_freq_mhz": 624.75},
        "temperatures_c": {"soc0-thermal": 46.218, "tj-thermal": 48.156},
        "power_mw": {"VDD_IN": 5364.48},
    }


def test_undecodable_bytes_are_skipped(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    (root / "proc/device-tree/model").write_bytes(b"\xff\xfe\x00")
    assert "model" not in BoardTelemetry(root).read()


def test_power_mode_without_conf_has_id_only(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    (root / "etc/nvpmodel.conf").unlink()
    assert BoardTelemetry(root).read()["power_mode"] == {"id": 0}


def test_power_mode_id_missing_from_conf_has_id_only(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    write(root / "var/lib/nvpmodel/status", "pmode:0002\n")
    assert BoardTelemetry(root).read()["power_mode"] == {"id": 2}


def test_iio_rail_without_power_file_uses_voltage_times_current(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "xavier")
    (root / XAVIER_IIO / "in_power1_input").unlink()
    assert BoardTelemetry(root).read()["power_mw"]["VDD_CPU_GPU_CV"] == 5016 * 408 / 1000


def test_unconnected_hwmon_channel_is_skipped(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    write(root / ORIN_HWMON / "in3_label", "NC\n")
    assert "NC" not in BoardTelemetry(root).read()["power_mw"]


def test_second_monitor_at_another_address_is_read(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    hwmon = root / "sys/bus/i2c/drivers/ina3221/1-0041/hwmon/hwmon2"
    write(hwmon / "in1_label", "VDDQ_VDD2_1V8AO\n")
    write(hwmon / "in1_input", "5000\n")
    write(hwmon / "curr1_input", "100\n")
    write(root / "sys/bus/i2c/drivers/ina3221/uevent", "DRIVER=ina3221\n")  # driver-level files are not devices
    assert BoardTelemetry(root).read()["power_mw"]["VDDQ_VDD2_1V8AO"] == 500.0


def test_gpu_devfreq_found_by_name_with_load_under_device(tmp_path: Path) -> None:
    # L4T R36 names Orin's node 17000000.gpu; with no gpu.0 link, load is read through the node's device.
    node = tmp_path / "sys/class/devfreq/17000000.gpu"
    write(node / "cur_freq", "624750000\n")
    write(node / "device/load", "1000\n")
    write(tmp_path / "sys/class/devfreq/15340000.vic/cur_freq", "115200000\n")
    assert BoardTelemetry(tmp_path).read() == {"gpu": {"load_percent": 100.0, "freq_mhz": 624.75}}


def test_duplicate_zone_types_keep_both(tmp_path: Path) -> None:
    thermal = tmp_path / "sys/devices/virtual/thermal"
    for number, milli_c in ((0, "27800"), (1, "29800"), (10, "-5000")):
        write(thermal / f"thermal_zone{number}/type", "acpitz\n")
        write(thermal / f"thermal_zone{number}/temp", f"{milli_c}\n")
    write(thermal / "cooling_device0/type", "Processor\n")
    assert BoardTelemetry(tmp_path).read() == {"temperatures_c": {"acpitz": 27.8, "acpitz_1": 29.8, "acpitz_10": -5.0}}


def test_read_is_cached_within_the_interval(tmp_path: Path) -> None:
    root = board_copy(tmp_path, "orin")
    clock = FakeClock()
    board = BoardTelemetry(root, min_interval_s=1.0, clock=clock)
    first = board.read()
    assert first["gpu"]["load_percent"] == 28.7

    write(root / "sys/devices/platform/gpu.0/load", "950\n")
    clock.now += 0.9
    assert board.read() == first

    clock.now += 0.1
    assert board.read()["gpu"]["load_percent"] == 95.0


def test_callers_cannot_edit_the_cache() -> None:
    board = BoardTelemetry(FIXTURES / "orin", clock=FakeClock())
    board.read()["power_mw"].clear()
    assert board.read() == ORIN


def test_prometheus_samples() -> None:
    samples = prometheus_samples(ORIN)
    by_series = {(name, tuple(sorted(labels.items()))): value for name, _help, labels, value in samples}
    assert by_series == {
        ("edgellm_board_gpu_load_percent", ()): 28.7,
        ("edgellm_board_gpu_freq_mhz", ()): 306.0,
        ("edgellm_board_temperature_celsius", (("zone", "cpu-thermal"),)): 48.156,
        ("edgellm_board_temperature_celsius", (("zone", "gpu-thermal"),)): 46.843,
        ("edgellm_board_temperature_celsius", (("zone", "soc0-thermal"),)): 46.218,
        ("edgellm_board_temperature_celsius", (("zone", "tj-thermal"),)): 48.156,
        ("edgellm_board_power_milliwatts", (("rail", "VDD_IN"),)): 5364.48,
        ("edgellm_board_power_milliwatts", (("rail", "VDD_CPU_GPU_CV"),)): 934.72,
        ("edgellm_board_power_milliwatts", (("rail", "VDD_SOC"),)): 1503.68,
        ("edgellm_board_power_mode", (("name", "15W"),)): 0.0,
    }
    assert all(help_text and isinstance(value, float) for _name, help_text, _labels, value in samples)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({}, []),
        ({"power_mode": {"id": 3}}, [("edgellm_board_power_mode", {"name": ""}, 3.0)]),
        ({"gpu": {"max_freq_mhz": 624.75}}, []),
    ],
)
def test_prometheus_samples_only_for_present_fields(data: dict, expected: list) -> None:
    assert [(name, labels, value) for name, _help, labels, value in prometheus_samples(data)] == expected


def test_the_node_reports_the_board_in_status_and_metrics(tmp_path):
    """A real node whose board_root is the Orin fixture tree: /status carries the reading, /metrics the gauges."""
    from tests.nodeproc import NodeProcess

    orin = Path(__file__).resolve().parents[1] / "fixtures" / "board" / "orin"
    node = NodeProcess(tmp_path, env={"EDGELLM_BOARD_ROOT": str(orin)}).start()
    try:
        with node.client() as c:
            board = c.get("/status").json()["result"]["board"]
            prom = c.get("/metrics", params={"format": "prometheus"}).text
    finally:
        node.stop()
    assert board["model"] == "NVIDIA Jetson Orin Nano Developer Kit"
    assert board["power_mode"] == {"id": 0, "name": "15W"} and board["power_mw"]["VDD_IN"] == 5364.48
    assert 'edgellm_board_power_milliwatts{rail="VDD_IN"} 5364.48' in prom
    assert 'edgellm_board_temperature_celsius{zone="tj-thermal"}' in prom
    assert "edgellm_board_gpu_load_percent 28.7" in prom
