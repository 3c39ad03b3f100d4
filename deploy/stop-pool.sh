#!/usr/bin/env bash
# Stop the kvroute workers that deploy/start-pool.sh started on this machine.
#
#   deploy/stop-pool.sh [--log-dir DIR] [--grace SECONDS] [ROLE]
#
# For every DIR/ROLE-i.pid (all roles unless ROLE is given): SIGTERM the worker itself,
# which drains (takes no new work, finishes what it has, then exits); once it has exited,
# SIGTERM the rest of its process group (vLLM's engine processes, which would abort their
# requests on a SIGTERM of their own, so they must not get one earlier). Whatever is left
# after the grace period (default 60 s, longer than the workers' 30 s drain) gets SIGKILL,
# and the pid file is removed. Running it again when nothing is left is a no-op that exits 0.
set -euo pipefail

PROG=${0##*/}
DEFAULT_LOG_DIR=${KVROUTE_POOL_DIR:-${XDG_STATE_HOME:-${HOME:-/tmp}/.local/state}/kvroute/pool}

usage() {
    cat <<EOF
usage: $PROG [--log-dir DIR] [--grace SECONDS] [ROLE]

Stop the workers whose pid files are in DIR (default: $DEFAULT_LOG_DIR).

  ROLE               prefill, decode, unified or node-store (start-pool.sh --node-store-gib);
                     default: all
  --log-dir DIR      where deploy/start-pool.sh wrote logs and pid files
  --grace SECONDS    wait this long after SIGTERM before SIGKILL (default: 60)
  -h, --help         this text
EOF
}

die() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    printf "Try '%s --help'.\n" "$PROG" >&2
    exit 2
}

need_value() {  # need_value FLAG NEXT_ARG_COUNT [VALUE]
    [[ $2 -ge 2 && ${3:-} != --* ]] || die "$1 needs a value"
}

# The process group led by $1 still has a member that is not a zombie.
group_alive() {
    local pgid=$1
    if command -v ps >/dev/null 2>&1; then
        ps -e -o pgid=,stat= | awk -v g="$pgid" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
    else
        kill -0 -- "-$pgid" 2>/dev/null
    fi
}

# The worker (the group's leader) itself is still running (a zombie counts as gone).
leader_alive() {
    local state
    state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ -n $state && $state != Z* ]]
}

log_dir=$DEFAULT_LOG_DIR
grace=60
role=""

while [[ $# -gt 0 ]]; do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --log-dir) need_value "$1" $# "${2:-}"; log_dir=$2; shift 2 ;;
        --log-dir=*) log_dir=${1#*=}; shift ;;
        --grace) need_value "$1" $# "${2:-}"; grace=$2; shift 2 ;;
        --grace=*) grace=${1#*=}; shift ;;
        -*) die "unknown option '$1'" ;;
        *)
            [[ -z $role ]] || die "at most one ROLE, got '$role' and '$1'"
            role=$1; shift ;;
    esac
done

case $role in
    "" | prefill | decode | unified | node-store) ;;
    *) die "ROLE must be 'prefill', 'decode', 'unified' or 'node-store', not '$role'" ;;
esac
[[ $grace =~ ^[0-9]+$ ]] || die "--grace must be a whole number of seconds, not '$grace'"

if [[ ! -d $log_dir ]]; then
    echo "nothing to stop: $log_dir does not exist"
    exit 0
fi

shopt -s nullglob
if [[ -n $role ]]; then
    pid_files=("$log_dir/$role"-*.pid)
else
    pid_files=("$log_dir"/prefill-*.pid "$log_dir"/decode-*.pid "$log_dir"/unified-*.pid "$log_dir"/node-store-*.pid)
fi
if [[ ${#pid_files[@]} -eq 0 ]]; then
    echo "nothing to stop: no ${role:+$role }pid files in $log_dir"
    exit 0
fi

# Send SIGTERM to every worker first, so they drain in parallel.
names=()
pids=()
for pid_file in "${pid_files[@]}"; do
    name=$(basename -- "$pid_file" .pid)
    pid=$(<"$pid_file") || pid=""
    if [[ ! $pid =~ ^[0-9]+$ || $pid -le 1 ]]; then
        echo "$name: pid file $pid_file holds no valid pid; removed"
        rm -f -- "$pid_file"
        continue
    fi
    if ! group_alive "$pid"; then
        echo "$name: not running (pid $pid); removed its stale pid file"
        rm -f -- "$pid_file"
        continue
    fi
    # The group leader is the worker itself; if it still exists it must be a kvroute
    # process, or the pid was reused by something else that must not be touched.
    if [[ -r /proc/$pid/cmdline ]] && ! tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q kvroute; then
        echo "$name: pid $pid now belongs to another program ($(tr '\0' ' ' <"/proc/$pid/cmdline" | cut -c1-80)); not signalled, pid file removed"
        rm -f -- "$pid_file"
        continue
    fi
    kill -TERM -- "$pid" 2>/dev/null || true
    names+=("$name")
    pids+=("$pid")
done

# Wait for them, then SIGKILL what outlived the grace period (vLLM's engine-core and
# model-worker processes may linger a few seconds after the worker itself).
ticks=0  # of 0.2 s; counted rather than read from $SECONDS, which has whole-second steps
remaining=${#pids[@]}
declare -A done_at=()
declare -A group_signalled=()
while [[ $remaining -gt 0 ]]; do
    remaining=0
    for idx in "${!pids[@]}"; do
        [[ -z ${done_at[$idx]:-} ]] || continue
        pid=${pids[$idx]}
        # The worker has drained and exited: now the rest of its group may stop.
        if [[ -z ${group_signalled[$idx]:-} ]] && ! leader_alive "$pid"; then
            kill -TERM -- "-$pid" 2>/dev/null || true
            group_signalled[$idx]=1
        fi
        if group_alive "$pid"; then
            remaining=$((remaining + 1))
        else
            done_at[$idx]="$((ticks / 5)).$((ticks % 5 * 2))"
        fi
    done
    [[ $remaining -gt 0 && $ticks -lt $((grace * 5)) ]] || break
    sleep 0.2
    ticks=$((ticks + 1))
done

for idx in "${!pids[@]}"; do
    name=${names[$idx]}
    pid=${pids[$idx]}
    if [[ -n ${done_at[$idx]:-} ]]; then
        echo "stopped $name (pid $pid) with SIGTERM in ${done_at[$idx]} s"
    else
        kill -KILL -- "-$pid" 2>/dev/null || true
        for ((tries = 0; tries < 50; tries++)); do
            group_alive "$pid" || break
            sleep 0.1
        done
        echo "killed $name (pid $pid) with SIGKILL after a ${grace} s grace period"
    fi
    rm -f -- "$log_dir/$name.pid"
done
echo "stopped ${#pids[@]} worker(s)${role:+ of role $role} from $log_dir"
