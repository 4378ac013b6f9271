#!/bin/sh
# The image's entrypoint: runs `baton "$@"`, with two conveniences for containers.
#
# - A BATON_* variable set to the empty string is removed, so a compose file can pass
#   `BATON_X: ${BATON_X:-}` through and "unset" keeps baton's own default.
# - BATON_HOST=auto and BATON_ADVERTISE_HOST=auto become this container's own address, the
#   one peers on the same container network reach it at. With host networking that name
#   often resolves to a loopback address: there, give the host's address instead.
set -eu

for name in $(env | sed -n 's/^\(BATON_[A-Za-z0-9_]*\)=$/\1/p'); do
    unset "$name"
done

own_address() {
    me=$(cat /proc/sys/kernel/hostname)
    addr=$(getent ahostsv4 "$me" | awk 'NR == 1 { print $1 }')
    case $addr in
        "" | 127.*)
            echo "baton-entrypoint: $1=auto found no routable address for '$me'" \
                "(got '$addr'); set $1 to this host's address" >&2
            exit 2
            ;;
    esac
    echo "$addr"
}

if [ "${BATON_HOST:-}" = auto ]; then
    BATON_HOST=$(own_address BATON_HOST)
    export BATON_HOST
fi
if [ "${BATON_ADVERTISE_HOST:-}" = auto ]; then
    BATON_ADVERTISE_HOST=$(own_address BATON_ADVERTISE_HOST)
    export BATON_ADVERTISE_HOST
fi

exec baton "$@"
