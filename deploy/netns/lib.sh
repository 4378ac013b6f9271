# shellcheck shell=bash disable=SC2034  # the variables are used by up.sh and down.sh
# Names and helpers shared by up.sh and down.sh (sourced, not run).
#
# One run = one bridge + one network namespace per process. Every name carries the run id
# (1-6 characters of [a-z0-9]), so parallel runs and leftovers of crashed runs never
# collide, and down.sh can find everything of a run from its id alone:
#
#   namespaces   baton-<run>-boot  baton-<run>-router  baton-<run>-p<i>  baton-<run>-d<i>
#   bridge       bbr-<run>                       (root namespace, holds <subnet>.1)
#   veth pairs   bv-<run>-<b|r|p<i>|d<i>> on the bridge  <->  eth0 inside the namespace
#   state        $BATON_NETNS_STATE/<run>/ : cluster.env, pids, logs/<process>.log
#
# Interface names are limited to 15 characters, hence the short forms.

NETNS_STATE_ROOT=${BATON_NETNS_STATE:-/tmp/baton-netns}
NETNS_PREFIX=${BATON_NETNS_PREFIX:-10.77}  # runs take <prefix>.<1..254>.0/24
NETNS_LOCK=/run/lock/baton-netns.lock
[[ -d /run/lock ]] || NETNS_LOCK=/tmp/baton-netns.lock

# Fixed ports are safe: every process has a network namespace of its own.
BOOTSTRAP_PORT=7000
ROUTER_PORT=8000
WORKER_PORT=9000
METRICS_PORT=9100

header_help() { # print a script's leading comment block, without the '#'
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$1"
}

die() {
    echo "netns: $*" >&2
    exit 1
}

valid_run_id() {
    [[ $1 =~ ^[a-z0-9]{1,6}$ ]]
}

new_run_id() {
    od -An -N3 -tx1 /dev/urandom | tr -d ' \n'
}

ns_name() { # ns_name RUN MEMBER  (MEMBER: boot, router, p0, d0, ...)
    echo "baton-$1-$2"
}

bridge_name() {
    echo "bbr-$1"
}

link_name() { # link_name RUN MEMBER SIDE  (SIDE: v = bridge side, n = namespace side)
    local short=$2
    case $short in
        boot) short=b ;;
        router) short=r ;;
    esac
    echo "b$3-$1-$short"
}

# the last octet of a member's address inside the run's /24
member_octet() {
    case $1 in
        boot) echo 2 ;;
        router) echo 3 ;;
        p*) echo $((10 + ${1#p})) ;;
        d*) echo $((50 + ${1#d})) ;;
        *) die "unknown member $1" ;;
    esac
}

# namespaces of a run, workers first: the order processes are stopped in
run_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^baton-$1-(p[0-9]+|d[0-9]+)$" || true
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^baton-$1-(router|boot)$" | sort -r || true
}

# run ids that have anything left on this machine: a namespace or a bridge
all_runs() {
    {
        ip netns list 2>/dev/null | awk '{print $1}' |
            sed -nE 's/^baton-([a-z0-9]{1,6})-(boot|router|p[0-9]+|d[0-9]+)$/\1/p'
        ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' |
            sed -nE 's/^bbr-([a-z0-9]{1,6})(@.*)?$/\1/p'
    } | sort -u
}

# true if no interface address and no route of this machine lies in SUBNET (a.b.c)
subnet_free() {
    local net=${1//./\\.}
    ! ip -4 -o addr show 2>/dev/null | grep -qE " inet $net\.[0-9]+/" &&
        ! ip -4 route show 2>/dev/null | grep -qE "^$net\.[0-9]+(/| )"
}

http_ok() { # http_ok URL: true if it answers 2xx within 2 s (never through a proxy)
    if command -v curl >/dev/null 2>&1; then
        curl -fsS -m 2 --noproxy '*' -o /dev/null "$1" 2>/dev/null
    else
        python3 - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open(sys.argv[1], timeout=2) as r:
    sys.exit(0 if 200 <= r.status < 300 else 1)
PY
    fi
}
