#!/usr/bin/env bash
# A real single-node HDFS (Hadoop 2.7.3 NameNode + DataNode with WebHDFS) for trajtrack's tests.
#
# No Docker, no Maven: the Hadoop jars come from the pyspark 2.4.8 sdist on PyPI and Jersey 1
# from Debian (docs/hdfs.md, "The test cluster"). Everything binds to 127.0.0.1 on free ports
# picked at start; ports and PIDs are written into the cluster directory, and faults are
# injected by those recorded PIDs only (never by process name).
#
# Usage:
#   hdfs-test-cluster.sh install                 jars into the cache, Jersey 1 via apt-get
#   hdfs-test-cluster.sh start DIR               format + start NN and DN, wait until writable
#   hdfs-test-cluster.sh stop DIR                stop both (TERM, then KILL)
#   hdfs-test-cluster.sh status DIR              print ports/PIDs; exit 0 when writable
#   hdfs-test-cluster.sh kill-namenode DIR       kill -9 the NameNode   (fault injection)
#   hdfs-test-cluster.sh kill-datanode DIR       kill -9 the DataNode
#   hdfs-test-cluster.sh start-namenode DIR      start it again (same ports and data)
#   hdfs-test-cluster.sh start-datanode DIR
#   hdfs-test-cluster.sh wait-healthy DIR [SECS] wait until a small write succeeds
#   hdfs-test-cluster.sh safemode enter|leave|get DIR
#   hdfs-test-cluster.sh env DIR                 shell assignments (ports, URLs, HADOOP_CONF_DIR)
#
# Environment: TRAJTRACK_HADOOP_CACHE (jar cache, default ~/.cache/trajtrack/hadoop-2.7.3),
# TRAJTRACK_JERSEY_DIR (where Debian's Jersey 1 jars are, default /usr/share/java),
# JAVA (java binary, default: java on PATH), TRAJTRACK_HDFS_HEAP (JVM -Xmx, default 768m),
# PYTHON (default python3).
set -euo pipefail

CACHE="${TRAJTRACK_HADOOP_CACHE:-$HOME/.cache/trajtrack/hadoop-2.7.3}"
JARS="$CACHE/jars"
JAVA="${JAVA:-java}"
HEAP="${TRAJTRACK_HDFS_HEAP:-768m}"
PYTHON="${PYTHON:-python3}"
JERSEY_PACKAGES=(libjersey1-core-java libjersey1-server-java libjersey1-servlet-java)
# jsr311-api must come before pyspark's javax.ws.rs-api-2.0.1.jar (else every WebHDFS call
# answers 500 AbstractMethodError); Jersey 1 is what the NameNode's servlet needs.
JERSEY_DIR="${TRAJTRACK_JERSEY_DIR:-/usr/share/java}"
JERSEY_JARS=("$JERSEY_DIR/jsr311-api.jar" "$JERSEY_DIR/jersey1-core.jar"
    "$JERSEY_DIR/jersey1-server.jar" "$JERSEY_DIR/jersey1-servlet.jar")
NN_CLASS=org.apache.hadoop.hdfs.server.namenode.NameNode
DN_CLASS=org.apache.hadoop.hdfs.server.datanode.DataNode
ADMIN_CLASS=org.apache.hadoop.hdfs.tools.DFSAdmin

die() { echo "hdfs-test-cluster: $*" >&2; exit 1; }
log() { echo "hdfs-test-cluster: $*" >&2; }

# ------------------------------------------------------------------------------- install

jersey_present() {
    local jar
    for jar in "${JERSEY_JARS[@]}"; do [ -f "$jar" ] || return 1; done
}

jars_present() {
    [ -f "$JARS/.complete" ] && [ -f "$JARS/hadoop-hdfs-2.7.3.jar" ]
}

install_jersey() {
    jersey_present && return 0
    command -v apt-get >/dev/null || die "Jersey 1 jars missing and no apt-get: install ${JERSEY_PACKAGES[*]}"
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo -n)
    log "installing ${JERSEY_PACKAGES[*]}"
    if ! DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "${JERSEY_PACKAGES[@]}" >&2; then
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "${JERSEY_PACKAGES[@]}" >&2
    fi
    jersey_present || die "Jersey 1 jars still missing after apt-get install"
}

install_jars() {
    jars_present && return 0
    local work
    work="$(mktemp -d "${TMPDIR:-/tmp}/trajtrack-hadoop-dl.XXXXXX")"
    # The download runs in a subshell whose EXIT trap removes the work directory, whichever
    # way it ends. (A RETURN trap would outlive this function -- bash keeps it set -- and fire
    # again when the caller returns, where $work is unbound under `set -u`.)
    (
        trap 'rm -rf "$work"' EXIT
        download_jars "$work"
    )
}

# Fetches the Hadoop 2.7.3 jars into $JARS, using the scratch directory $1.
download_jars() {
    local work="$1" sdist
    log "downloading the pyspark 2.4.8 sdist for its Hadoop 2.7.3 jars (~220 MB, once)"
    # A throwaway venv: pyspark 2.4.8's setup.py needs an old pypandoc under build isolation,
    # so build its metadata without isolation, with just setuptools and wheel.
    "$PYTHON" -m venv "$work/venv"
    "$work/venv/bin/python" -m pip install -q --disable-pip-version-check setuptools wheel >&2
    "$work/venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
        --no-build-isolation --no-binary :all: -d "$work/dl" pyspark==2.4.8 >&2
    sdist="$(ls "$work"/dl/pyspark-2.4.8.tar.gz)"
    mkdir -p "$work/x"
    tar -xzf "$sdist" -C "$work/x" --wildcards 'pyspark-2.4.8/deps/jars/*'
    rm -f "$sdist"
    mkdir -p "$CACHE"
    rm -rf "$JARS.partial"
    mv "$work/x/pyspark-2.4.8/deps/jars" "$JARS.partial"
    [ -f "$JARS.partial/hadoop-hdfs-2.7.3.jar" ] || die "the sdist has no hadoop-hdfs-2.7.3.jar"
    touch "$JARS.partial/.complete"
    rm -rf "$JARS"
    mv "$JARS.partial" "$JARS"
    log "jars cached in $JARS"
}

cmd_install() {
    command -v "$JAVA" >/dev/null || die "no java on PATH (Java 8-17 is needed for Hadoop 2.7.3)"
    install_jersey
    install_jars
}

# ------------------------------------------------------------------------------- cluster

need_dir() {
    [ -n "${1:-}" ] || die "missing the cluster directory argument"
    mkdir -p "$1"
    cd "$1" && pwd
}

load_env() {
    [ -f "$1/cluster.env" ] || die "$1 holds no cluster (no cluster.env): run start first"
    # shellcheck disable=SC1091
    . "$1/cluster.env"
}

classpath() {
    local dir="$1" cp="$1/conf:$1/res" jar
    for jar in "${JERSEY_JARS[@]}"; do cp="$cp:$jar"; done
    echo "$cp:$JARS/*"
}

# Sets JAVA_CMD to the java command line for main class $2 of the cluster in $1.
java_cmd() {
    # -Dtrajtrack.hdfs.cluster marks our JVMs, so a recorded PID is only ever signalled after
    # checking it still belongs to this cluster (PIDs get reused).
    local dir="$1"
    shift
    JAVA_CMD=("$JAVA" "-Xmx$HEAP" -XX:+UseSerialGC -Djava.net.preferIPv4Stack=true
        "-Dtrajtrack.hdfs.cluster=$dir" "-Dhadoop.log.dir=$dir/logs"
        "-Dlog4j.configuration=file:$dir/conf/log4j.properties" -cp "$(classpath "$dir")" "$@")
}

free_ports() {
    "$PYTHON" - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

prop() { printf '  <property><name>%s</name><value>%s</value></property>\n' "$1" "$2"; }

write_config() {
    local dir="$1" user
    user="$(id -un)"
    mkdir -p "$dir/conf" "$dir/res/webapps/hdfs" "$dir/res/webapps/datanode" "$dir/logs" \
        "$dir/data/name" "$dir/data/data"
    {
        echo '<?xml version="1.0"?><configuration>'
        prop fs.defaultFS "hdfs://127.0.0.1:$NN_RPC_PORT"
        prop hadoop.tmp.dir "$dir/data/tmp"
        # Fail fast when the NameNode is down: the DataNode's embedded client (WebHDFS CREATE)
        # otherwise retries the connection 10+ times before answering.
        prop ipc.client.connect.max.retries 2
        prop ipc.client.connect.retry.interval 300
        prop ipc.client.connect.max.retries.on.timeouts 2
        prop ipc.client.connect.timeout 5000
        # Group lookups of made-up users (the permission test's) must not shell out slowly.
        prop hadoop.security.groups.cache.warn.after.ms 60000
        echo '</configuration>'
    } >"$dir/conf/core-site.xml"
    {
        echo '<?xml version="1.0"?><configuration>'
        prop dfs.replication 1
        prop dfs.namenode.name.dir "file://$dir/data/name"
        prop dfs.datanode.data.dir "file://$dir/data/data"
        prop dfs.namenode.rpc-address "127.0.0.1:$NN_RPC_PORT"
        prop dfs.namenode.http-address "127.0.0.1:$NN_HTTP_PORT"
        prop dfs.namenode.secondary.http-address "127.0.0.1:0"
        prop dfs.datanode.address "127.0.0.1:$DN_DATA_PORT"
        prop dfs.datanode.http.address "127.0.0.1:$DN_HTTP_PORT"
        prop dfs.datanode.ipc.address "127.0.0.1:$DN_IPC_PORT"
        # The CREATE redirect must name an address the client can reach (not "localhost").
        prop dfs.datanode.hostname 127.0.0.1
        prop dfs.datanode.use.datanode.hostname false
        prop dfs.webhdfs.enabled true
        # Permissions ON: the permission test writes as a user without access. The user that
        # runs the NameNode is the superuser, so the suite's own user may write anywhere.
        prop dfs.permissions.enabled true
        prop dfs.permissions.superusergroup supergroup
        # Safe mode ends as soon as the blocks are reported (default extension: 30 s).
        prop dfs.namenode.safemode.extension 0
        prop dfs.namenode.safemode.min.datanodes 0
        # Heartbeats: a restarted DataNode (same ports) re-registers on its next heartbeat and
        # a restarted NameNode hears from the DataNode within a second. A killed DataNode is
        # declared dead after 2*recheck + 10*heartbeat = 2*5 s + 10*1 s = 20 s (default
        # ~10.5 min): with one DataNode that only changes the error (no DataNode at all vs a
        # connection refused at the redirect), both are retried by the client.
        prop dfs.heartbeat.interval 1
        prop dfs.namenode.heartbeat.recheck-interval 5000
        prop dfs.blockreport.initialDelay 0
        prop dfs.namenode.stale.datanode.interval 3000
        # One DataNode: never try to replace it in a write pipeline.
        prop dfs.client.block.write.replace-datanode-on-failure.enable false
        prop dfs.datanode.du.reserved 0
        prop dfs.namenode.fs-limits.min-block-size 1048576
        echo '</configuration>'
    } >"$dir/conf/hdfs-site.xml"
    cat >"$dir/conf/log4j.properties" <<'EOF'
log4j.rootLogger=INFO,console
log4j.appender.console=org.apache.log4j.ConsoleAppender
log4j.appender.console.target=System.err
log4j.appender.console.layout=org.apache.log4j.PatternLayout
log4j.appender.console.layout.ConversionPattern=%d{ISO8601} %p %c{2}: %m%n
log4j.logger.org.apache.hadoop.hdfs.StateChange=WARN
log4j.logger.BlockStateChange=WARN
log4j.logger.org.apache.hadoop.hdfs.server.datanode.DataNode.clienttrace=WARN
log4j.logger.org.apache.hadoop.hdfs.server.namenode.FSNamesystem.audit=WARN
log4j.logger.org.apache.hadoop.util.NativeCodeLoader=ERROR
EOF
    cat >"$dir/cluster.env" <<EOF
NN_RPC_PORT=$NN_RPC_PORT
NN_HTTP_PORT=$NN_HTTP_PORT
DN_DATA_PORT=$DN_DATA_PORT
DN_HTTP_PORT=$DN_HTTP_PORT
DN_IPC_PORT=$DN_IPC_PORT
HDFS_SUPERUSER=$user
HADOOP_CONF_DIR=$dir/conf
WEBHDFS_URL=webhdfs://127.0.0.1:$NN_HTTP_PORT
HDFS_URL=hdfs://127.0.0.1:$NN_RPC_PORT
EOF
}

# Whether PID $2 is a live JVM of the cluster in $1.
ours() {
    [ -n "$2" ] && [ -r "/proc/$2/cmdline" ] &&
        tr '\0' '\n' <"/proc/$2/cmdline" | grep -qxF -- "-Dtrajtrack.hdfs.cluster=$1"
}

pid_of() { [ -f "$1/$2.pid" ] && cat "$1/$2.pid" || true; }

start_role() {
    local dir="$1" role="$2" class pid
    case "$role" in
        namenode) class=$NN_CLASS ;;
        datanode) class=$DN_CLASS ;;
        *) die "unknown role $role" ;;
    esac
    pid="$(pid_of "$dir" "$role")"
    if ours "$dir" "$pid"; then
        log "$role already running (pid $pid)"
        return 0
    fi
    java_cmd "$dir" "$class"
    nohup "${JAVA_CMD[@]}" >>"$dir/logs/$role.log" 2>&1 </dev/null &
    echo $! >"$dir/$role.pid"
    log "$role started (pid $!)"
}

kill_role() {
    local dir="$1" role="$2" signal="$3" pid i
    pid="$(pid_of "$dir" "$role")"
    if ! ours "$dir" "$pid"; then
        rm -f "$dir/$role.pid"
        return 0
    fi
    kill "-$signal" "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do
        ours "$dir" "$pid" || break
        [ "$i" -eq 100 ] && { kill -KILL "$pid" 2>/dev/null || true; sleep 0.2; }
        sleep 0.1
    done
    rm -f "$dir/$role.pid"
    log "$role stopped (pid $pid, SIG$signal)"
}

# Poll until WebHDFS answers (mode "up") or a small write commits (mode "writable").
wait_for() {
    local dir="$1" mode="$2" secs="$3"
    "$PYTHON" - "$NN_HTTP_PORT" "$HDFS_SUPERUSER" "$mode" "$secs" "$dir" <<'EOF'
import json, sys, time, urllib.error, urllib.request
port, user, mode, secs, cdir = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
base = f"http://127.0.0.1:{port}/webhdfs/v1"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

def call(method, url, data=None):
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/octet-stream")
    with opener.open(req, timeout=10) as res:
        return res.status, res.read()

def writable():
    # The two-step CREATE (urllib does not follow a 307 for PUT): the write only succeeds with
    # a live DataNode and the NameNode out of safe mode.
    try:
        call("PUT", f"{base}/.trajtrack-probe?op=CREATE&overwrite=true&user.name={user}")
        raise OSError("CREATE answered without a redirect")
    except urllib.error.HTTPError as exc:
        if exc.code != 307:
            raise
        location = exc.headers["Location"]
    call("PUT", location, b"ok")
    call("DELETE", f"{base}/.trajtrack-probe?op=DELETE&user.name={user}")
    return True

end = time.monotonic() + secs
last = None
while time.monotonic() < end:
    try:
        if mode == "up":
            call("GET", f"{base}/?op=GETFILESTATUS&user.name={user}")
            sys.exit(0)
        if writable():
            sys.exit(0)
    except (OSError, urllib.error.URLError) as exc:
        last = exc
    time.sleep(0.3)
print(f"hdfs-test-cluster: not {mode} after {secs:.0f} s: {last}; logs in {cdir}/logs",
      file=sys.stderr)
sys.exit(1)
EOF
}

cmd_start() {
    local dir
    dir="$(need_dir "${1:-}")"
    command -v "$JAVA" >/dev/null || die "no java on PATH"
    jars_present || die "no Hadoop jars in $JARS: run '$0 install' first"
    jersey_present || die "Jersey 1 jars missing: run '$0 install' first"
    if [ -f "$dir/cluster.env" ]; then
        load_env "$dir"
        if ours "$dir" "$(pid_of "$dir" namenode)" || ours "$dir" "$(pid_of "$dir" datanode)"; then
            die "a cluster is already running in $dir (stop it first)"
        fi
    fi
    read -r NN_RPC_PORT NN_HTTP_PORT DN_DATA_PORT DN_HTTP_PORT DN_IPC_PORT < <(free_ports 5)
    write_config "$dir"
    load_env "$dir"
    rm -rf "$dir/data/name" "$dir/data/data"
    mkdir -p "$dir/data/name" "$dir/data/data"
    java_cmd "$dir" "$NN_CLASS" -format -nonInteractive -force
    "${JAVA_CMD[@]}" >"$dir/logs/format.log" 2>&1 ||
        die "NameNode format failed; see $dir/logs/format.log"
    start_role "$dir" namenode
    start_role "$dir" datanode
    if ! wait_for "$dir" writable "${TRAJTRACK_HDFS_START_TIMEOUT:-120}"; then
        tail -n 20 "$dir/logs/namenode.log" "$dir/logs/datanode.log" >&2 || true
        cmd_stop "$dir"
        exit 1
    fi
    log "ready: WebHDFS http://127.0.0.1:$NN_HTTP_PORT, RPC 127.0.0.1:$NN_RPC_PORT ($dir)"
}

cmd_stop() {
    local dir
    dir="$(need_dir "${1:-}")"
    kill_role "$dir" datanode TERM
    kill_role "$dir" namenode TERM
}

cmd_status() {
    local dir nn dn
    dir="$(need_dir "${1:-}")"
    load_env "$dir"
    nn="$(pid_of "$dir" namenode)"
    dn="$(pid_of "$dir" datanode)"
    ours "$dir" "$nn" && echo "namenode: running (pid $nn)" || echo "namenode: stopped"
    ours "$dir" "$dn" && echo "datanode: running (pid $dn)" || echo "datanode: stopped"
    cat "$dir/cluster.env"
    wait_for "$dir" writable 3
}

cmd_safemode() {
    local action="${1:-}" dir
    case "$action" in enter | leave | get) ;; *) die "safemode enter|leave|get DIR" ;; esac
    dir="$(need_dir "${2:-}")"
    load_env "$dir"
    # As the superuser (the user that started the NameNode), whatever the caller's env says.
    java_cmd "$dir" "$ADMIN_CLASS" -fs "hdfs://127.0.0.1:$NN_RPC_PORT" -safemode "$action"
    env -u HADOOP_USER_NAME "${JAVA_CMD[@]}" 2>>"$dir/logs/dfsadmin.log"
}

main() {
    local cmd="${1:-}"
    shift || true
    case "$cmd" in
        install) cmd_install ;;
        start) cmd_start "$@" ;;
        stop) cmd_stop "$@" ;;
        status) cmd_status "$@" ;;
        kill-namenode | kill-datanode)
            local dir
            dir="$(need_dir "${1:-}")"
            kill_role "$dir" "${cmd#kill-}" KILL
            ;;
        start-namenode | start-datanode)
            local dir
            dir="$(need_dir "${1:-}")"
            load_env "$dir"
            start_role "$dir" "${cmd#start-}"
            if [ "$cmd" = start-namenode ]; then wait_for "$dir" up 60; fi
            ;;
        wait-healthy)
            local dir
            dir="$(need_dir "${1:-}")"
            load_env "$dir"
            wait_for "$dir" writable "${2:-120}"
            ;;
        safemode) cmd_safemode "$@" ;;
        env)
            local dir
            dir="$(need_dir "${1:-}")"
            cat "$dir/cluster.env"
            ;;
        *) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
}

main "$@"
