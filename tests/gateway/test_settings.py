"""The engine's settings: LORAMUX_* variables mapped to EngineConfig in one place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loramux.engine.config import EngineConfig
from loramux.gateway import serve_workers
from loramux.gateway.cli import build_parser, main
from loramux.gateway.engine_child import engine_child
from loramux.gateway.serve_workers import (
    available_cores,
    cgroup_cpu_quota,
    default_workers,
    own_cgroup,
)
from loramux.gateway.setting_checks import MAX_USAGE_MODEL, ConfigError
from loramux.gateway.settings import EngineSettings, ServerSettings, Settings

MODEL = Path("model")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        "DTYPE", "DEVICE", "KV_CACHE_MB", "MAX_NUM_SEQS", "MAX_WAITING", "MAX_BATCHED_TOKENS",
        "MAX_MODEL_LEN",
        "MAX_LORAS", "MAX_CPU_LORAS", "MAX_LORA_RANK", "PREFIX_CACHING", "CUDA_GRAPHS",
        "FUSED_KERNELS", "ASYNC_SCHEDULING", "LORA_LOAD_WORKERS", "LORA_COPY_GROUPS_PER_STEP",
        "ENGINE_THREADS",
    ):  # fmt: skip
        monkeypatch.delenv(f"LORAMUX_{name}", raising=False)
    return monkeypatch


def test_unset_settings_give_the_engine_its_own_defaults(clean_env: pytest.MonkeyPatch) -> None:
    assert EngineSettings().engine_config(MODEL) == EngineConfig(model=MODEL)


def test_loramux_variables_reach_the_engine_config(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in {
        "DTYPE": "bfloat16",
        "KV_CACHE_MB": "32",
        "MAX_NUM_SEQS": "3",
        "MAX_WAITING": "7",
        "MAX_BATCHED_TOKENS": "96",
        "MAX_MODEL_LEN": "200",
        "MAX_LORAS": "2",
        "LORA_MEMORY_MB": "48",
        "MAX_CPU_LORAS": "5",
        "MAX_LORA_RANK": "16",
        "PREFIX_CACHING": "0",
        "CUDA_GRAPHS": "0",
        "FUSED_KERNELS": "0",
        "ASYNC_SCHEDULING": "1",
        "LORA_LOAD_WORKERS": "2",
        "LORA_COPY_GROUPS_PER_STEP": "3",
        "ENGINE_THREADS": "1",
    }.items():
        clean_env.setenv(f"LORAMUX_{name}", value)
    config = EngineSettings().engine_config(MODEL, random_weights=True)
    assert config == EngineConfig(
        model=MODEL,
        random_weights=True,
        dtype="bfloat16",
        kv_cache_bytes=32 << 20,
        max_num_seqs=3,
        max_waiting=7,
        max_num_batched_tokens=96,
        max_model_len=200,
        max_loras=2,
        lora_memory_bytes=48 << 20,
        max_cpu_loras=5,
        max_lora_rank=16,
        lora_load_workers=2,
        lora_copy_groups_per_step=3,
        enable_prefix_caching=False,
        cuda_graphs=False,
        fused_kernels=False,
        async_scheduling=True,
        cpu_threads=1,
    )


@pytest.mark.parametrize("value", ["0", "-3"])
def test_an_adapter_memory_that_is_not_positive_is_refused(
    clean_env: pytest.MonkeyPatch, value: str
) -> None:
    clean_env.setenv("LORAMUX_LORA_MEMORY_MB", value)
    with pytest.raises(ValueError, match="LORAMUX_LORA_MEMORY_MB"):
        EngineSettings().engine_config(MODEL)


@pytest.mark.parametrize("value", ["0", "-2", "4097", str(2**31), str(10**20)])
def test_engine_threads_out_of_range_are_refused_before_the_engine_starts(
    clean_env: pytest.MonkeyPatch, value: str
) -> None:
    clean_env.setenv("LORAMUX_ENGINE_THREADS", value)
    with pytest.raises(ValueError, match="LORAMUX_ENGINE_THREADS"):
        EngineSettings().engine_config(MODEL)


@pytest.mark.parametrize("workers", [1, 2, 64])
def test_serves_engine_runs_on_the_cores_its_gateway_workers_leave(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, workers: int
) -> None:
    child = engine_child(Settings(data_dir=tmp_path), workers)
    cores = len(os.sched_getaffinity(0))
    assert child.spec.env["LORAMUX_ENGINE_THREADS"] == str(max(1, cores - workers))


def test_engine_threads_given_in_code_reach_serves_engine(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path, engine=EngineSettings(engine_threads=1))
    assert engine_child(settings, 1).spec.env["LORAMUX_ENGINE_THREADS"] == "1"


def test_engine_threads_an_operator_sets_reach_serves_engine(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("LORAMUX_ENGINE_THREADS", "5")
    child = engine_child(Settings(data_dir=tmp_path), 1)
    assert child.spec.env["LORAMUX_ENGINE_THREADS"] == "5"


def test_fields_given_in_code_win_over_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LORAMUX_MAX_NUM_SEQS", "3")
    assert EngineSettings(max_num_seqs=7).engine_config(MODEL).max_num_seqs == 7


def test_an_invalid_setting_is_refused_by_the_engine_config(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LORAMUX_MAX_LORA_RANK", "512")
    with pytest.raises(ValueError, match=r"LORAMUX_MAX_LORA_RANK must be within 1\.\.256, not 512"):
        EngineSettings().engine_config(MODEL)


BOOLEANS = ["PREFIX_CACHING", "CUDA_GRAPHS", "FUSED_KERNELS", "ASYNC_SCHEDULING"]


@pytest.mark.parametrize("name", BOOLEANS)
@pytest.mark.parametrize(
    ("value", "meant"),
    [
        *[("1", True), ("true", True), ("Yes", True), (" ON ", True)],
        *[("0", False), ("FALSE", False), ("no", False), ("Off", False)],
    ],
)
def test_a_boolean_setting_reads_its_words_in_any_case(
    clean_env: pytest.MonkeyPatch, name: str, value: str, meant: bool
) -> None:
    clean_env.setenv(f"LORAMUX_{name}", value)
    assert getattr(EngineSettings(), name.lower()) is meant


@pytest.mark.parametrize("name", BOOLEANS)
@pytest.mark.parametrize("value", ["enabled", "ture", "2", "y", "disabled", "-"])
def test_a_boolean_setting_that_is_no_boolean_is_refused_by_name(
    clean_env: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """Anything but 1, true, yes or on was read as off: LORAMUX_PREFIX_CACHING=enabled
    silently turned prefix caching off."""
    clean_env.setenv(f"LORAMUX_{name}", value)
    with pytest.raises(ConfigError, match=rf"LORAMUX_{name} must be a boolean .*, not '{value}'"):
        EngineSettings()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_usage_flush_interval_that_is_not_a_positive_number_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("LORAMUX_USAGE_FLUSH_SECONDS", value)
    with pytest.raises(ValueError, match="LORAMUX_USAGE_FLUSH_SECONDS"):
        ServerSettings()


def _refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> str:
    """The message of the error that LORAMUX_`name`=`value` gets from the settings (a
    ConfigError, which `loramux` prints as one line)."""
    monkeypatch.setenv(f"LORAMUX_{name}", value)
    with pytest.raises(ValueError) as refused:
        Settings()
    return str(refused.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PORT", "abc"),
        ("PORT", "8000.0"),
        ("KV_CACHE_MB", "nan"),
        ("MAX_BODY_KB", "1e3"),
        ("QUOTA_REDIS_TIMEOUT_MS", "1.5"),
        ("ENGINE_THREADS", "two"),
        ("KEY_CACHE_SECONDS", "soon"),
    ],
)
def test_a_variable_that_is_not_a_number_is_refused_by_name_and_value(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """int() and float() alone say "invalid literal ... 'abc'", naming no variable."""
    assert f"LORAMUX_{name} must be" in _refused(monkeypatch, name, value)


@pytest.mark.parametrize("value", ["-1", "0", "65536", "70000", str(2**64 + 8000)])
def test_a_port_out_of_range_is_refused_before_serve_starts_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """Found only by the bind, after redis-server and the engine had started and the demo
    tenant's key was printed (2**64 + 8000 even bound 8000 in one path)."""
    assert f"LORAMUX_PORT must be within 1..65535, not {value}" in _refused(
        monkeypatch, "PORT", value
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", value])
    assert "--port: must be an integer within 1..65535" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KV_CACHE_MB", "0"),
        ("MAX_NUM_SEQS", "0"),
        ("MAX_WAITING", "-1"),
        ("MAX_BATCHED_TOKENS", "-5"),
        ("MAX_MODEL_LEN", "0"),
        ("MAX_LORAS", "0"),
        ("MAX_CPU_LORAS", "-1"),
        ("LORA_LOAD_WORKERS", "0"),
        ("LORA_COPY_GROUPS_PER_STEP", "0"),
        ("ENGINE_THREADS", "0"),
        ("ADMIN_TOKEN_MAX_TTL", "0"),
        ("MAX_UPLOAD_MB", "0"),
        ("MAX_BODY_KB", "-1"),
        ("MAX_HEADER_KB", "0"),
        ("DEFAULT_MAX_TOKENS", "0"),
        ("USAGE_MAX_BUFFERED", "-3"),
        ("DEMO_ADAPTERS", "-1"),
        ("KEY_CACHE_SECONDS", "-1"),
        ("QUOTA_REDIS_TIMEOUT_MS", "0"),
        ("QUOTA_CONFIG_CACHE_SECONDS", "-0.5"),
        ("QUOTA_SLOT_LEASE_SECONDS", "0"),
        ("CACHE_MAX_ENTRIES_PER_BUCKET", "0"),
        ("CACHE_MIRROR_MB", "-1"),
        ("CACHE_REDIS_TIMEOUT_MS", "-100"),
    ],
)
def test_a_size_count_or_timeout_out_of_its_bounds_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """LORAMUX_MAX_BODY_KB=-1 was served, answering every request with a body 413;
    LORAMUX_ENGINE_THREADS=0 was taken as unset by serve and refused by `loramux engine`."""
    assert f"LORAMUX_{name} must be" in _refused(monkeypatch, name, value)


def test_engine_urls_are_read_without_the_spaces_around_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "tcp://a:8100, tcp://b:8100" kept " tcp://b:8100", which ZeroMQ refuses ("Protocol not
    supported"): serve ended in that traceback."""
    monkeypatch.setenv("LORAMUX_ENGINE_URLS", " tcp://a:8100, ipc:///run/engine.sock ,")
    assert Settings().server.engine_urls == ("tcp://a:8100", "ipc:///run/engine.sock")


@pytest.mark.parametrize(
    "value", ["tcp://engine", "tcp://engine:http", "tcp://*:8100", "engine:8100", "http://e:8100"]
)
def test_an_engine_url_that_is_no_engine_address_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    assert f"LORAMUX_ENGINE_URLS holds {value!r}" in _refused(monkeypatch, "ENGINE_URLS", value)
    with pytest.raises(ConfigError, match="LORAMUX_ENGINE_URLS"):
        ServerSettings(engine_urls=("ipc:///run/engine.sock", value))


def test_a_base_model_id_longer_than_usage_stores_is_refused_naming_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Usage records the base model's id in a column of MAX_USAGE_MODEL characters: PostgreSQL
    refused every event of a longer one, so its requests were served and never billed."""
    longest = "m" * MAX_USAGE_MODEL
    monkeypatch.setenv("LORAMUX_MODEL_NAME", longest)
    assert Settings().model_name == longest
    message = _refused(monkeypatch, "MODEL_NAME", longest + "m")
    assert message.startswith(f"LORAMUX_MODEL_NAME is {MAX_USAGE_MODEL + 1} characters long")
    monkeypatch.delenv("LORAMUX_MODEL_NAME")
    message = _refused(monkeypatch, "MODEL", str(tmp_path / (longest + "m")))
    assert message.startswith("the model folder's name (LORAMUX_MODEL=")
    assert "LORAMUX_MODEL_NAME unset" in message


@pytest.mark.parametrize("name", ["DATABASE_URL", "ADAPTER_STORE_URL"])
@pytest.mark.parametrize(
    "value",
    [
        "not-a-url",
        "postgresql://loramux:hunter2@db:five432/loramux",  # a port that is no number
        "postgresq://loramux:hunter2@db/loramux",  # no such database
    ],
)
def test_a_database_url_that_cannot_be_used_is_refused_by_name_without_its_password(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str
) -> None:
    """It passed the settings: `loramux migrate` ended in SQLAlchemy's traceback (which, for an
    unparsable URL, some versions print with the URL in it), and serve only after its
    redis-server and engine had started."""
    message = _refused(monkeypatch, name, value)
    assert f"LORAMUX_{name} " in message and "hunter2" not in message
    monkeypatch.setenv("LORAMUX_DATA_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        main(["migrate"])
    assert str(exited.value.code).startswith(f"loramux migrate: LORAMUX_{name} ")


def test_engine_threads_0_is_refused_alike_by_serve_and_the_engine(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("LORAMUX_ENGINE_THREADS", "0")
    with pytest.raises(ValueError, match=r"LORAMUX_ENGINE_THREADS must be within 1\.\.4096, not 0"):
        engine_child(Settings(data_dir=tmp_path), 1)


@pytest.mark.parametrize(
    "name",
    [
        "ENGINE_FIRST_OUTPUT_SECONDS",
        "KEY_CACHE_SECONDS",
        "USAGE_FLUSH_SECONDS",
        "QUOTA_CONFIG_CACHE_SECONDS",
        "QUOTA_SLOT_LEASE_SECONDS",
    ],
)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_nan_and_infinity_are_refused_for_every_float_setting(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """LORAMUX_KEY_CACHE_SECONDS=inf kept revoked keys working for good, and
    LORAMUX_QUOTA_SLOT_LEASE_SECONDS=nan became int(nan * 1000) at the first request."""
    message = _refused(monkeypatch, name, value)
    assert f"LORAMUX_{name} must be" in message and value.lstrip("-") in message


TIME_BOUNDS = [
    # variable, least and most accepted, values above, a harmful one below (None: 0 is least)
    ("ENGINE_FIRST_OUTPUT_SECONDS", "1", "3600", ["3601", "1e300"], "1e-300"),  # all 504s
    ("KEY_CACHE_SECONDS", "0", "300", ["300.5", "1e300"], None),
    ("USAGE_FLUSH_SECONDS", "0.1", "3600", ["3601", "1e300"], "1e-300"),  # the writer spins
    ("STOP_GRACE_SECONDS", "0", "3600", ["3601", str(10**30)], None),
    ("ADMIN_TOKEN_MAX_TTL", "1", "31622400", ["31622401", str(10**30)], None),
    ("QUOTA_CONFIG_CACHE_SECONDS", "0", "3600", ["3601", "1e300"], None),
    ("QUOTA_SLOT_LEASE_SECONDS", "1", "3600", ["3601", "86400"], "0.001"),  # renewals spin
    ("QUOTA_REDIS_TIMEOUT_MS", "1", "60000", ["60001", str(10**30)], None),
    ("CACHE_REDIS_TIMEOUT_MS", "1", "60000", ["60001", str(10**30)], None),
]


@pytest.mark.parametrize(("name", "least", "most", "above", "harmful"), TIME_BOUNDS)
def test_every_time_setting_is_bounded_above_and_where_less_harms_below(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    least: str,
    most: str,
    above: list[str],
    harmful: str | None,
) -> None:
    """Only infinity was refused above: LORAMUX_KEY_CACHE_SECONDS=1e300 kept revoked keys
    working in other workers for good, LORAMUX_USAGE_FLUSH_SECONDS=1e-300 spun the usage
    writer, and LORAMUX_ENGINE_FIRST_OUTPUT_SECONDS=1e-300 made every request a 504."""
    for value in [*above, *([harmful] if harmful else [])]:
        assert f"LORAMUX_{name} must be within {least}..{most}" in _refused(
            monkeypatch, name, value
        )
    for value in (least, most):
        monkeypatch.setenv(f"LORAMUX_{name}", value)
        Settings()


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 2),
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu.max": "not a quota"}, None),
        ({"cpu.max": "100000 0"}, None),
        ({"cpu.max": "100000 -100000"}, None),
        ({"cpu.max": "-1 100000"}, None),
        ({"cpu.max": "0 100000"}, None),
        ({}, None),
    ],
)
def test_a_containers_cpu_quota_is_read_from_its_cgroup(
    tmp_path: Path, files: dict[str, str], cpus: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == cpus


def test_serve_splits_the_cpus_a_quota_allows_not_the_hosts_cores(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A container limited to 1 CPU on a bigger host: one worker, one engine thread."""
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    clean_env.setattr(serve_workers, "CGROUP", tmp_path)
    assert available_cores() == 1
    assert default_workers() == 1
    child = engine_child(Settings(data_dir=tmp_path / "data"), default_workers())
    assert child.spec.env["LORAMUX_ENGINE_THREADS"] == "1"


def test_a_quota_on_the_processs_own_cgroup_or_an_ancestor_below_the_mount_is_seen(
    tmp_path: Path,
) -> None:
    """cgroup v2 without a cgroup namespace (a systemd unit with CPUQuota=, docker
    --cgroupns=host): the mount's root has no quota; the process's cgroup (from
    /proc/self/cgroup) or one above it does. The smallest on the way counts."""
    service = tmp_path / "system.slice" / "loramux.service"
    service.mkdir(parents=True)
    (tmp_path / "system.slice" / "cpu.max").write_text("max 100000\n")
    (service / "cpu.max").write_text("200000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "/system.slice/loramux.service") == 2
    (service / "cpu.max").write_text("max 100000\n")
    (tmp_path / "system.slice" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "/system.slice/loramux.service") == 2
    (service / "cpu.max").write_text("100000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "/system.slice/loramux.service") == 1
    listing = tmp_path / "cgroup"
    listing.write_text("1:name=systemd:/x\n0::/system.slice/loramux.service\n")
    assert own_cgroup(listing) == "/system.slice/loramux.service"
    assert own_cgroup(tmp_path / "missing") == "/"
