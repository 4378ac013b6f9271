#!/usr/bin/env bash
# Start a baton cluster with every process in a network namespace of its own.
#
# Emulates a multi-host deployment on one machine: bootstrap, router, and each prefill and
# decode worker gets its own network stack and address on a private bridge, so every
# control-plane call and every KV transfer crosses a (virtual) network interface, never
# loopback. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2.
#
#   deploy/netns/up.sh [--prefill N] [--decode M] [--run ID] [--subnet A.B.C] [--timeout S]
#                      [--bind-any]
#
# --bind-any: every process binds 0.0.0.0 in its namespace and advertises the namespace's
# address, as processes in containers do (the default binds the namespace's address).
#
# Prints the router URL once the router and every worker report healthy, and writes
# $BATON_NETNS_STATE/<run>/cluster.env (addresses, for scripts and tests). On failure it
# shows the logs and removes everything it made. Stop the run with `down.sh <run>`.
#
# Worker and router settings come from the usual BATON_* variables (BATON_MODEL,
# BATON_PAGE_SIZE, BATON_TRANSFER_BACKEND, BATON_CLUSTER_TOKEN, ...), which every process
# inherits; addresses and ports are set here. BATON_CMD is the baton command line
# (default `baton`, e.g. "python -m baton.services.cli").
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=deploy/netns/lib.sh
source "$HERE/lib.sh"

usage() {
    header_help "$0"
    exit "${1:-0}"
}

n_prefill=1
n_decode=1
run=${BATON_NETNS_RUN:-}
subnet=${BATON_NETNS_SUBNET:-}
timeout=${BATON_NETNS_TIMEOUT:-180}
bind_any=${BATON_NETNS_BIND_ANY:-0}
while (($#)); do
    case $1 in
        --prefill) n_prefill=$2; shift 2 ;;
        --decode) n_decode=$2; shift 2 ;;
        --run) run=$2; shift 2 ;;
        --subnet) subnet=$2; shift 2 ;;
        --timeout) timeout=$2; shift 2 ;;
        --bind-any) bind_any=1; shift ;;
        -h | --help) usage 0 ;;
        *) echo "unknown argument: $1" >&2; usage 2 ;;
    esac
done

[[ $n_prefill =~ ^[0-9]+$ && $n_prefill -ge 1 && $n_prefill -le 40 ]] || die "--prefill must be 1..40"
[[ $n_decode =~ ^[0-9]+$ && $n_decode -ge 1 && $n_decode -le 40 ]] || die "--decode must be 1..40"
run=${run:-$(new_run_id)}
valid_run_id "$run" || die "run id must be 1-6 characters of [a-z0-9], got '$run'"
command -v ip >/dev/null || die "iproute2 (ip) is not installed"
read -r -a baton <<<"${BATON_CMD:-baton}"
command -v "${baton[0]}" >/dev/null || die "'${baton[0]}' not found; set BATON_CMD"

members=(boot router)
for ((i = 0; i < n_prefill; i++)); do members+=("p$i"); done
for ((i = 0; i < n_decode; i++)); do members+=("d$i"); done

if [[ -n $(run_namespaces "$run") ]] || ip link show "$(bridge_name "$run")" >/dev/null 2>&1; then
    die "run '$run' already exists on this machine; stop it first: $HERE/down.sh $run"
fi

state=$NETNS_STATE_ROOT/$run
mkdir -p "$NETNS_STATE_ROOT"
rm -rf "$state"
mkdir -p "$state/logs"
chmod 700 "$state"  # cluster.env holds the cluster token

ok=0
on_exit() {
    if ((ok == 0)); then
        echo "netns: start-up of run '$run' failed; last lines of each log:" >&2
        for log in "$state"/logs/*.log; do
            [[ -f $log ]] || continue
            echo "---- $(basename "$log")" >&2
            tail -n 25 "$log" >&2
        done
        if [[ ${BATON_NETNS_KEEP_ON_FAILURE:-0} == 1 ]]; then
            echo "netns: kept for inspection; remove with $HERE/down.sh $run" >&2
        else
            "$HERE/down.sh" "$run" >&2 || true
        fi
    fi
}
trap on_exit EXIT

# ---- network: pick a free /24 and make the bridge under a lock, so parallel runs differ
bridge=$(bridge_name "$run")
exec 9>"$NETNS_LOCK"
flock -w 30 9 || die "could not take $NETNS_LOCK"
if [[ -z $subnet ]]; then
    for ((c = 1; c <= 254; c++)); do
        if subnet_free "$NETNS_PREFIX.$c"; then subnet=$NETNS_PREFIX.$c; break; fi
    done
    [[ -n $subnet ]] || die "no free /24 left in $NETNS_PREFIX.0.0/16; set BATON_NETNS_PREFIX"
fi
[[ $subnet =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "subnet must look like 10.77.3, got '$subnet'"
subnet_free "$subnet" || die "$subnet.0/24 is already used on this machine"
ip link add "$bridge" type bridge
ip addr add "$subnet.1/24" dev "$bridge"
ip link set "$bridge" up
flock -u 9
exec 9>&-

# With br_netfilter, bridged frames pass iptables' FORWARD chain, which Docker sets to DROP.
if [[ $(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo 0) == 1 ]] &&
    iptables -S FORWARD 2>/dev/null | grep -q '^-P FORWARD DROP'; then
    echo "netns: warning: iptables drops forwarded traffic, which includes this bridge's;" \
        "allow it with: iptables -I FORWARD -i $bridge -o $bridge -j ACCEPT" >&2
fi

addr_of() { echo "$subnet.$(member_octet "$1")"; }
bind_of() { if ((bind_any)); then echo 0.0.0.0; else addr_of "$1"; fi; }

for m in "${members[@]}"; do
    ns=$(ns_name "$run" "$m")
    outer=$(link_name "$run" "$m" v)
    inner=$(link_name "$run" "$m" n)
    ip netns add "$ns"
    ip link add "$outer" type veth peer name "$inner"
    ip link set "$outer" master "$bridge" up
    ip link set "$inner" netns "$ns"
    ip -n "$ns" link set "$inner" name eth0
    ip -n "$ns" addr add "$(addr_of "$m")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
done

# ---- processes
if [[ -z ${BATON_CLUSTER_TOKEN:-} ]]; then
    BATON_CLUSTER_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
fi
export BATON_CLUSTER_TOKEN  # children read it from the environment, not the ps line

start() { # start MEMBER baton-args...
    local m=$1
    shift
    # setsid: the process outlives this script and the terminal it ran in
    ip netns exec "$(ns_name "$run" "$m")" setsid "${baton[@]}" "$@" \
        >"$state/logs/$m.log" 2>&1 </dev/null &
    echo "$m $!" >>"$state/pids"
}

boot_addr=$(addr_of boot)
router_addr=$(addr_of router)
bootstrap=$boot_addr:$BOOTSTRAP_PORT
start boot bootstrap --host "$(bind_of boot)" --port "$BOOTSTRAP_PORT"
for m in "${members[@]}"; do
    case $m in
        p*) role=prefill ;;
        d*) role=decode ;;
        *) continue ;;
    esac
    a=$(addr_of "$m")
    start "$m" "$role" --host "$(bind_of "$m")" --advertise-host "$a" --port "$WORKER_PORT" \
        --metrics-port "$METRICS_PORT" --registry "$bootstrap" --worker-id "$role-$run-$m"
done
start router router --host "$(bind_of router)" --port "$ROUTER_PORT" --registry "$bootstrap"

prefill_urls=() decode_urls=()
for m in "${members[@]}"; do
    case $m in
        p*) prefill_urls+=("http://$(addr_of "$m"):$METRICS_PORT") ;;
        d*) decode_urls+=("http://$(addr_of "$m"):$METRICS_PORT") ;;
    esac
done
router_url=http://$router_addr:$ROUTER_PORT
{
    echo "RUN=$run"
    echo "SUBNET=$subnet.0/24"
    echo "BRIDGE=$bridge"
    echo "BOOTSTRAP=$bootstrap"
    echo "ROUTER_URL=$router_url"
    echo "PREFILL_METRICS=\"${prefill_urls[*]}\""
    echo "DECODE_METRICS=\"${decode_urls[*]}\""
    echo "NAMESPACES=\"$(for m in "${members[@]}"; do printf '%s ' "$(ns_name "$run" "$m")"; done)\""
    echo "BATON_CLUSTER_TOKEN=$BATON_CLUSTER_TOKEN"
} >"$state/cluster.env"
chmod 600 "$state/cluster.env"

# ---- wait until the router has a usable pair and every worker is healthy
deadline=$((SECONDS + timeout))
while :; do
    while read -r m pid; do
        kill -0 "$pid" 2>/dev/null || die "$m exited during start-up (log: $state/logs/$m.log)"
    done <"$state/pids"
    healthy=1
    for url in "$router_url" "${prefill_urls[@]}" "${decode_urls[@]}"; do
        http_ok "$url/health" || { healthy=0; break; }
    done
    ((healthy)) && break
    ((SECONDS < deadline)) || die "not healthy within ${timeout}s"
    sleep 0.5
done

ok=1
echo "baton run '$run' is up: $router_url/v1 ($n_prefill prefill + $n_decode decode on $subnet.0/24)"
echo "state: $state/cluster.env; stop: $HERE/down.sh $run"
