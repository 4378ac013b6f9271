#!/usr/bin/env bash
# Stop a run started by up.sh and remove everything it made: its processes (workers first,
# then router, then bootstrap; SIGTERM, then SIGKILL after a grace period), its
# namespaces, veth pairs and bridge, and its state folder.
#
#   deploy/netns/down.sh RUN [--keep-logs]   one run (default: $BATON_NETNS_RUN)
#   deploy/netns/down.sh --all               every run on this machine, yours or not
#
# Safe to run any number of times, and on a run that only half started.
# BATON_NETNS_GRACE: seconds to wait after SIGTERM (default 20).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=deploy/netns/lib.sh
source "$HERE/lib.sh"

grace=${BATON_NETNS_GRACE:-20}
keep_logs=0
all=0
runs=()
while (($#)); do
    case $1 in
        --all) all=1 ;;
        --keep-logs) keep_logs=1 ;;
        -h | --help) header_help "$0"; exit 0 ;;
        *) runs+=("$1") ;;
    esac
    shift
done
if ((all)); then
    mapfile -t runs < <(all_runs)
elif ((${#runs[@]} == 0)); then
    [[ -n ${BATON_NETNS_RUN:-} ]] || die "which run? usage: down.sh RUN | --all"
    runs=("$BATON_NETNS_RUN")
fi

pids_of() { # processes living in the namespaces given
    local ns
    for ns in "$@"; do ip netns pids "$ns" 2>/dev/null; done
}

stop_processes() { # stop_processes NAMESPACE...: TERM, wait, then KILL what is left
    local left deadline
    # shellcheck disable=SC2046
    kill -TERM $(pids_of "$@") 2>/dev/null
    deadline=$((SECONDS + grace))
    while left=$(pids_of "$@") && [[ -n $left ]]; do
        if ((SECONDS >= deadline)); then
            echo "netns: still running after ${grace}s, killing: $(echo "$left" | tr '\n' ' ')" >&2
            # shellcheck disable=SC2086
            kill -KILL $left 2>/dev/null
            sleep 0.2
            break
        fi
        sleep 0.2
    done
}

for run in "${runs[@]}"; do
    valid_run_id "$run" || die "run id must be 1-6 characters of [a-z0-9], got '$run'"
    mapfile -t namespaces < <(run_namespaces "$run")
    workers=() others=()
    for ns in "${namespaces[@]}"; do
        if [[ $ns =~ -(p|d)[0-9]+$ ]]; then workers+=("$ns"); else others+=("$ns"); fi
    done
    # workers drain and deregister while the bootstrap is still there to hear it
    ((${#workers[@]})) && stop_processes "${workers[@]}"
    for ns in "${others[@]}"; do stop_processes "$ns"; done
    for ns in "${namespaces[@]}"; do
        ip netns delete "$ns" 2>/dev/null  # deleting a namespace deletes its veth pair
    done
    # bridge-side veths of a namespace that was never made
    ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' |
        grep -E "^bv-$run-" | while read -r link; do ip link delete "$link" 2>/dev/null; done
    ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' |
        grep -E "^bn-$run-" | while read -r link; do ip link delete "$link" 2>/dev/null; done
    ip link delete "$(bridge_name "$run")" 2>/dev/null
    if ((keep_logs)); then
        rm -f "$NETNS_STATE_ROOT/$run/cluster.env" "$NETNS_STATE_ROOT/$run/pids"
    else
        rm -rf "${NETNS_STATE_ROOT:?}/$run"
    fi
    echo "netns: run '$run' is down"
done
exit 0
