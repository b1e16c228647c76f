"""The ``trajtrack`` commands against the real HDFS test cluster (webhdfs:// URLs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hdfs import InsecureClient

from _support.hdfs_cluster import HdfsCluster
from cli._runs import WritesMarker, run_cli, run_json, write_run

pytestmark = pytest.mark.hdfs


def _client(cluster: HdfsCluster) -> InsecureClient:
    return InsecureClient(f"http://127.0.0.1:{cluster.http_port}", user=cluster.superuser)


def _path_of(url: str) -> str:
    return "/" + url.split("://", 1)[1].split("/", 1)[1]


def _dumps(bump: bool = False) -> dict[str, object]:
    dumps: dict[str, object] = {
        f"step{i}/x": {"t": torch.arange(12.0).reshape(3, 4) * i} for i in range(3)
    }
    if bump:
        dumps["step1/x"]["t"][2, 1] += 0.25  # type: ignore[index]
    return dumps


def test_ls_show_diff_verify_on_hdfs(
    hdfs_cluster: HdfsCluster, hdfs_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = f"{hdfs_url}/a", f"{hdfs_url}/b"
    write_run(a, _dumps())
    write_run(b, _dumps(bump=True))

    code, listing = run_json(capsys, "ls", a)
    assert code == 0
    assert [d["name"] for d in listing["dumps"]] == ["step0/x", "step1/x", "step2/x"]
    assert all(d["recorded"] and d["present"] for d in listing["dumps"])

    code, out, _ = run_cli(capsys, "show", b, "step1/x")
    assert code == 0 and "['t']: Tensor float32 [3, 4] cpu" in out

    assert run_cli(capsys, "diff", a, a)[0] == 0
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 1
    assert "first divergence: step1/x" in out and "first at index [2, 1]" in out
    assert run_cli(capsys, "diff", a, b, "--atol", "0.5")[0] == 0

    # Local copy of run A against HDFS run B: the same comparison across backends.
    local = str(tmp_path / "a")
    write_run(local, _dumps())
    code, report = run_json(capsys, "diff", local, b)
    assert code == 1 and report["first_divergence"] == "step1/x"

    code, out, _ = run_cli(capsys, "verify", a)
    assert code == 0 and "OK: 3 dumps checked: 3 ok" in out


def test_verify_on_hdfs_finds_corrupt_truncated_missing(
    hdfs_cluster: HdfsCluster, hdfs_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(hdfs_url, _dumps())
    client, root = _client(hdfs_cluster), _path_of(hdfs_url)
    with client.read(f"{root}/step0/x.pth") as reader:
        data = bytearray(reader.read())
    flipped = bytes(data[:100]) + bytes([data[100] ^ 0xFF]) + bytes(data[101:])
    client.write(f"{root}/step0/x.pth", data=flipped, overwrite=True)
    client.write(f"{root}/step1/x.pth", data=bytes(data[:-7]), overwrite=True)
    client.delete(f"{root}/step2/x.pth")
    code, report = run_json(capsys, "verify", hdfs_url)
    assert code == 1
    found = {p["name"]: p["problem"] for p in report["problems"]}
    assert found == {"step0/x": "corrupt", "step1/x": "truncated", "step2/x": "missing"}


def test_malicious_dump_on_hdfs_is_refused(
    hdfs_cluster: HdfsCluster, hdfs_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    write_run(hdfs_url, {"evil": {"p": WritesMarker(str(marker))}})
    code, _, err = run_cli(capsys, "show", hdfs_url, "evil")
    assert code == 2 and "refusing to load" in err
    assert not marker.exists()


def test_diff_html_report_on_hdfs(
    hdfs_cluster: HdfsCluster, hdfs_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'trajtrack[report]'")
    a, b = f"{hdfs_url}/report-a", f"{hdfs_url}/report-b"
    write_run(a, _dumps())
    write_run(b, _dumps(bump=True))
    report = tmp_path / "report.html"
    code, _, err = run_cli(capsys, "diff", a, b, "--html", str(report))
    assert code == 1, err
    page = report.read_text()
    assert 'id="first-divergence">step1/x</strong>' in page
    # The first divergent pair was reloaded from HDFS for the histogram.
    assert "step1/x [&#x27;t&#x27;]: float32 [3, 4], a - b of 12 elements" in page
    assert 'class="plot histogram"' in page


def _write_sharded(dest: str, dumps: dict[str, object]) -> None:
    import anyio

    import trajtrack

    async def go() -> None:
        async with trajtrack.Tracker(dest, layout="shards") as tracker:
            for name, obj in dumps.items():
                await tracker.dump(obj, name)

    anyio.run(go)


def test_a_sharded_run_on_hdfs(
    hdfs_cluster: HdfsCluster, hdfs_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sharded, files = f"{hdfs_url}/sharded", str(tmp_path / "files")
    _write_sharded(sharded, _dumps())
    write_run(files, _dumps())
    listed = _client(hdfs_cluster).list(_path_of(sharded))
    assert "step0" not in listed  # no file per dump: the dumps are in a shard
    code, listing = run_json(capsys, "ls", sharded)
    assert code == 0
    assert [d["name"] for d in listing["dumps"]] == ["step0/x", "step1/x", "step2/x"]
    assert all(d["shard"] for d in listing["dumps"])
    code, shown = run_json(capsys, "show", sharded, "step2/x")  # one ranged read (OPEN+offset)
    assert code == 0
    assert shown["structure"]["children"][0]["max"] == 22.0
    code, report = run_json(capsys, "verify", sharded)
    assert (code, report["counts"]["ok"]) == (0, 3)
    code, result = run_json(capsys, "diff", sharded, files)  # sharded on HDFS vs local files
    assert code == 0, result
    out = tmp_path / "exported"
    code, exported = run_json(capsys, "export", sharded, str(out))
    assert (code, exported["written"]) == (0, 3)
    loaded = torch.load(out / "step1/x.pth", weights_only=True)
    assert torch.equal(loaded["t"], torch.arange(12.0).reshape(3, 4))
