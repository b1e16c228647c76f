"""From a destination URL to WebHDFS endpoints: URL parsing and Hadoop configuration lookup.

``webhdfs://host:port/path`` and ``swebhdfs://`` name their NameNodes directly (several, for
HA, separated by ``,`` or ``;``). ``hdfs://authority/path`` names a NameNode's RPC address or a
nameservice, so its HTTP endpoints come from, in this order: the ``namenodes`` option, the
``TRAJTRACK_WEBHDFS_URL`` environment variable, or the Hadoop configuration in
``HADOOP_CONF_DIR`` (else ``$HADOOP_HOME/etc/hadoop``).
"""

from __future__ import annotations

import os
import posixpath
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from trajtrack._exceptions import ConfigurationError

__all__ = ["WebHdfsTarget", "resolve_target"]

#: Environment variable with the WebHDFS endpoints for ``hdfs://`` URLs.
ENDPOINTS_ENV = "TRAJTRACK_WEBHDFS_URL"
DEFAULT_HTTP_PORT = 9870  # Hadoop 3 (Hadoop 2: 50070)
DEFAULT_HTTPS_PORT = 9871
DEFAULT_RPC_PORT = 8020


@dataclass(frozen=True, slots=True)
class WebHdfsTarget:
    """Where a destination lives: the NameNodes' HTTP base URLs and the absolute root path."""

    namenodes: tuple[str, ...]
    root: str


def resolve_target(
    url: str,
    *,
    namenodes: str | Sequence[str] | None = None,
    hadoop_conf_dir: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> WebHdfsTarget:
    """Resolve a ``webhdfs://``, ``swebhdfs://`` or ``hdfs://`` URL to WebHDFS endpoints.

    Raises:
        ConfigurationError: The URL is malformed, or an ``hdfs://`` URL cannot be resolved
            (the message says what to set).
    """
    env = os.environ if environ is None else environ
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    root = _root_of(url, parts.path)
    authority = parts.netloc.rpartition("@")[2]
    if namenodes:
        return WebHdfsTarget(_endpoints(namenodes, "http", url), root)
    if scheme in ("webhdfs", "swebhdfs"):
        if not authority:
            raise ConfigurationError(f"{url}: a {scheme}:// URL needs host:port of the NameNode")
        http = "https" if scheme == "swebhdfs" else "http"
        return WebHdfsTarget(_endpoints(authority, http, url), root)
    if scheme != "hdfs":
        raise ConfigurationError(f"{url}: not a webhdfs://, swebhdfs:// or hdfs:// URL")
    from_env = env.get(ENDPOINTS_ENV)
    if from_env:
        return WebHdfsTarget(_endpoints(from_env, "http", url), root)
    conf_dir = _conf_dir(hadoop_conf_dir, env)
    conf = load_hadoop_conf(conf_dir) if conf_dir is not None else {}
    found = _from_conf(authority, conf)
    if not found:
        raise ConfigurationError(_unresolved_message(url, authority, conf_dir))
    return WebHdfsTarget(found, root)


def _root_of(url: str, path: str) -> str:
    root = posixpath.normpath("/" + unquote(path).lstrip("/")) if path else "/"
    if any(part in ("..",) for part in unquote(path).split("/")):
        raise ConfigurationError(f"{url}: '..' is not allowed in the destination path")
    return root


def _endpoints(spec: str | Sequence[str], http: str, url: str) -> tuple[str, ...]:
    items = [spec] if isinstance(spec, str) else list(spec)
    found: list[str] = []
    for item in items:
        for raw in item.replace(";", ",").split(","):
            entry = raw.strip().rstrip("/")
            if not entry:
                continue
            if "://" not in entry:
                port = DEFAULT_HTTPS_PORT if http == "https" else DEFAULT_HTTP_PORT
                entry = f"{http}://{entry}" if ":" in entry else f"{http}://{entry}:{port}"
            scheme = entry.partition("://")[0].lower()
            if scheme in ("webhdfs", "swebhdfs"):
                entry = ("https" if scheme == "swebhdfs" else "http") + entry[len(scheme) :]
            elif scheme not in ("http", "https"):
                raise ConfigurationError(f"{url}: bad WebHDFS endpoint {raw.strip()!r}")
            found.append(entry)
    if not found:
        raise ConfigurationError(f"{url}: no WebHDFS endpoint given")
    return tuple(found)


def _conf_dir(explicit: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Path | None:
    if explicit is not None:
        return Path(explicit)
    if env.get("HADOOP_CONF_DIR"):
        return Path(env["HADOOP_CONF_DIR"])
    if env.get("HADOOP_HOME"):
        candidate = Path(env["HADOOP_HOME"]) / "etc" / "hadoop"
        if candidate.is_dir():
            return candidate
    return None


def load_hadoop_conf(conf_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The properties of ``core-site.xml`` and ``hdfs-site.xml`` in *conf_dir* (later wins).

    Raises:
        ConfigurationError: A file exists but is not valid XML.
    """
    conf: dict[str, str] = {}
    for name in ("core-site.xml", "hdfs-site.xml"):
        path = Path(conf_dir) / name
        if not path.is_file():
            continue
        try:
            tree = ElementTree.parse(path)  # the user's own config files
        except ElementTree.ParseError as exc:
            raise ConfigurationError(f"cannot parse {path}: {exc}") from exc
        for prop in tree.getroot().iter("property"):
            key = (prop.findtext("name") or "").strip()
            if key:
                conf[key] = (prop.findtext("value") or "").strip()
    return conf


def _from_conf(authority: str, conf: Mapping[str, str]) -> tuple[str, ...]:
    if not authority:
        default_fs = urlsplit(conf.get("fs.defaultFS", conf.get("fs.default.name", "")))
        if default_fs.scheme.lower() != "hdfs" or not default_fs.netloc:
            return ()
        authority = default_fs.netloc
    https = conf.get("dfs.http.policy", "HTTP_ONLY").upper() == "HTTPS_ONLY"
    key, http = (
        ("dfs.namenode.https-address", "https") if https else ("dfs.namenode.http-address", "http")
    )
    nameservices = _split(conf.get("dfs.nameservices", ""))
    if authority in nameservices:
        return tuple(
            f"{http}://{conf[f'{key}.{authority}.{nn}']}"
            for nn in _split(conf.get(f"dfs.ha.namenodes.{authority}", ""))
            if conf.get(f"{key}.{authority}.{nn}")
        ) or _single(conf, key, http, authority)
    # A host[:port]: find the NameNode whose RPC address it is, then its HTTP address.
    host, _, port = authority.partition(":")
    rpc = f"{host}:{port or DEFAULT_RPC_PORT}"
    for name, value in conf.items():
        if name.startswith("dfs.namenode.rpc-address") and value.strip() == rpc:
            suffix = name[len("dfs.namenode.rpc-address") :]
            http_address = conf.get(key + suffix)
            if http_address:
                return (f"{http}://{_with_host(http_address, host)}",)
    # Non-HA, no rpc-address: the default file system's NameNode has the unsuffixed address.
    default_authority = urlsplit(conf.get("fs.defaultFS", "")).netloc
    if default_authority and _with_port(default_authority) == rpc and conf.get(key):
        return (f"{http}://{_with_host(conf[key], host)}",)
    return ()


def _with_port(authority: str) -> str:
    host, _, port = authority.partition(":")
    return f"{host}:{port or DEFAULT_RPC_PORT}"


def _single(conf: Mapping[str, str], key: str, http: str, nameservice: str) -> tuple[str, ...]:
    address = conf.get(f"{key}.{nameservice}")
    return (f"{http}://{address}",) if address else ()


def _with_host(address: str, host: str) -> str:
    # A NameNode listening on all interfaces publishes 0.0.0.0: reach it by the URL's host.
    bind, _, port = address.rpartition(":")
    return f"{host}:{port}" if bind in ("0.0.0.0", "", "[::]") else address


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _unresolved_message(url: str, authority: str, conf_dir: Path | None) -> str:
    where = (
        f"the Hadoop configuration in {conf_dir} has no WebHDFS address for "
        f"{authority or 'fs.defaultFS'!r}"
        if conf_dir is not None
        else "neither HADOOP_CONF_DIR nor HADOOP_HOME is set"
    )
    return (
        f"cannot resolve {url} to a WebHDFS endpoint: {where}. Set one of: "
        f"{ENDPOINTS_ENV}=http://<namenode-host>:<http-port> (several separated by ','; the HTTP "
        f"port is 9870 on Hadoop 3, 50070 on Hadoop 2); HADOOP_CONF_DIR to a directory whose "
        f"hdfs-site.xml defines dfs.namenode.http-address (and, for a nameservice, "
        f"dfs.nameservices, dfs.ha.namenodes.<ns>, dfs.namenode.http-address.<ns>.<nn>); the "
        f"storage option namenodes=[...]; or use webhdfs://<namenode-host>:<http-port>/<path>"
    )
