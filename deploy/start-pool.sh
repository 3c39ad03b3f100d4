#!/usr/bin/env bash
# Start a pool of kvroute workers of one role on this machine.
#
#   deploy/start-pool.sh ROLE COUNT --orchestrator ADDR (--cluster-keys DIR | --insecure-no-auth)
#                        [--model M] [--host H] [--log-dir DIR] [--python PY] [--node-store-gib N]
#                        [-- extra worker flags...]
#
# One worker per GPU where `nvidia-smi -L` finds GPUs (worker i gets the i-th GPU
# through CUDA_VISIBLE_DEVICES; COUNT "auto" means one per GPU); otherwise worker i
# is pinned to CPU core (i mod nproc) with --omp-threads-bind. Every worker leads its
# own process group, in the caller's session, logs to DIR/ROLE-i.log and has its pid in
# DIR/ROLE-i.pid, which deploy/stop-pool.sh uses to stop the whole group. With
# --node-store-gib N, this machine's node KV store (kvroute node-store) is started first
# unless it already runs (DIR/node-store-0.pid), and every worker is pointed at it.
#
# Not a session of its own: Linux's scheduler autogroups share CPU between sessions
# first, and a worker in its own session starved on a core it shared with a busy
# worker of another session (README, "Engines sharing cores"). Start the pools that
# share cores from one session.
set -euo pipefail

PROG=${0##*/}
REPO_ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
DEFAULT_LOG_DIR=${KVROUTE_POOL_DIR:-${XDG_STATE_HOME:-${HOME:-/tmp}/.local/state}/kvroute/pool}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}    # overridable, e.g. to force CPU mode in tests
STARTUP_CHECK_SECONDS=${KVROUTE_POOL_STARTUP_CHECK:-2}
NODE_STORE_ADDRESS=tcp://127.0.0.1:7390  # kvroute node-store's default bind

usage() {
    cat <<EOF
usage: $PROG ROLE COUNT --orchestrator ADDR (--cluster-keys DIR | --insecure-no-auth) [options]
       [-- extra worker flags...]

Start COUNT kvroute workers of ROLE on this machine, each in its own process group.

  ROLE                  prefill, decode or unified (one engine that does both)
  COUNT                 number of workers, or "auto" for one per GPU
  --orchestrator ADDR   registry address of the orchestrator, e.g. tcp://10.0.0.1:7001
                        (host:port is accepted too); repeat for orchestrator replicas, or
                        give dns://NAME:PORT for every address NAME resolves to
  --cluster-keys DIR    the cluster's key folder (kvroute keys init / worker-set; default:
                        \$KVROUTE_CLUSTER_KEYS): every ZeroMQ socket authenticated and encrypted
  --insecure-no-auth    no keys: sockets in clear, open to anyone who reaches them (only on
                        a network nobody else can reach)
  --model M             model folder or hub id (must match the orchestrator's)
  --host H              address other machines use to reach these workers; the workers
                        then bind 0.0.0.0 (override with -- --bind-host IP)
  --log-dir DIR         logs and pid files (default: $DEFAULT_LOG_DIR)
  --python PY           interpreter (default: the repo's .venv/bin/python, else python3)
  --node-store-gib N    this machine's node KV store with N GiB of host memory, started unless it
                        already runs (shared by every pool started with the same --log-dir), at
                        $NODE_STORE_ADDRESS; every worker writes its blocks through to it and loads
                        prompts from it (docs/operations.md, "Running a node KV store")
  -h, --help            this text

Flags after -- go to every worker unchanged (see: PY -m kvroute ROLE-worker --help).
Stop the pool with: deploy/stop-pool.sh --log-dir DIR [ROLE]
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

# ------------------------------------------------------------------ arguments

positional=()
orchestrators=()
cluster_keys=${KVROUTE_CLUSTER_KEYS:-}
insecure=
model=""
host=""
log_dir=$DEFAULT_LOG_DIR
python=""
node_store_gib=""
extra=()

while [[ $# -gt 0 ]]; do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --orchestrator) need_value "$1" $# "${2:-}"; orchestrators+=("$2"); shift 2 ;;
        --orchestrator=*) orchestrators+=("${1#*=}"); shift ;;
        --cluster-keys) need_value "$1" $# "${2:-}"; cluster_keys=$2; shift 2 ;;
        --cluster-keys=*) cluster_keys=${1#*=}; shift ;;
        --insecure-no-auth) insecure=1; shift ;;
        --model) need_value "$1" $# "${2:-}"; model=$2; shift 2 ;;
        --model=*) model=${1#*=}; shift ;;
        --host) need_value "$1" $# "${2:-}"; host=$2; shift 2 ;;
        --host=*) host=${1#*=}; shift ;;
        --log-dir) need_value "$1" $# "${2:-}"; log_dir=$2; shift 2 ;;
        --log-dir=*) log_dir=${1#*=}; shift ;;
        --python) need_value "$1" $# "${2:-}"; python=$2; shift 2 ;;
        --python=*) python=${1#*=}; shift ;;
        --node-store-gib) need_value "$1" $# "${2:-}"; node_store_gib=$2; shift 2 ;;
        --node-store-gib=*) node_store_gib=${1#*=}; shift ;;
        --) shift; extra=("$@"); break ;;
        -*) die "unknown option '$1' (worker flags go after --)" ;;
        *) positional+=("$1"); shift ;;
    esac
done

[[ ${#positional[@]} -eq 2 ]] || die "expected ROLE and COUNT, got ${#positional[@]} positional argument(s): ${positional[*]:-none}"
role=${positional[0]}
count=${positional[1]}

case $role in
    prefill | decode | unified) ;;
    *) die "ROLE must be 'prefill', 'decode' or 'unified', not '$role'" ;;
esac

[[ -z $node_store_gib || $node_store_gib =~ ^[0-9]*\.?[0-9]+$ && ! $node_store_gib =~ ^[0.]+$ ]] \
    || die "--node-store-gib must be a positive number of GiB, not '$node_store_gib'"
[[ -n $cluster_keys || -n $insecure ]] || die "--cluster-keys DIR is required (create it with: kvroute keys init DIR), or --insecure-no-auth on a network nobody else can reach"
[[ -z $cluster_keys || -z $insecure ]] || die "--cluster-keys and --insecure-no-auth exclude each other"
[[ -z $cluster_keys || -d $cluster_keys ]] || die "--cluster-keys '$cluster_keys' is not a folder (create it with: kvroute keys init DIR)"
[[ ${#orchestrators[@]} -gt 0 ]] || die "--orchestrator ADDR is required (the orchestrator's registry, e.g. tcp://10.0.0.1:7001)"
for i in "${!orchestrators[@]}"; do
    address=${orchestrators[$i]}
    [[ $address == *://* ]] || address="tcp://$address"
    [[ $address =~ ^(tcp|dns)://[^/]+:[0-9]+$ ]] \
        || die "--orchestrator '${orchestrators[$i]}' is not a registry address like tcp://HOST:PORT or dns://NAME:PORT"
    orchestrators[i]=$address
done

if [[ -z $python ]]; then
    if [[ -x $REPO_ROOT/.venv/bin/python ]]; then
        python=$REPO_ROOT/.venv/bin/python
    else
        python=python3
    fi
fi
command -v -- "$python" >/dev/null 2>&1 || die "python interpreter '$python' not found or not executable"

# ------------------------------------------------------------------ devices

gpus=()
if command -v -- "$NVIDIA_SMI" >/dev/null 2>&1 && smi_out=$("$NVIDIA_SMI" -L 2>/dev/null); then
    gpu_count=$(grep -c '^GPU ' <<<"$smi_out" || true)
    if [[ $gpu_count -gt 0 ]]; then
        if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
            # Respect a restriction the operator already made: hand out those devices only.
            IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
        else
            for ((g = 0; g < gpu_count; g++)); do gpus+=("$g"); done
        fi
    fi
fi

if [[ $count == auto ]]; then
    [[ ${#gpus[@]} -gt 0 ]] || die "COUNT 'auto' means one worker per GPU, but $NVIDIA_SMI -L found no GPU; give a number"
    count=${#gpus[@]}
fi
[[ $count =~ ^[1-9][0-9]*$ ]] || die "COUNT must be a positive integer or 'auto', not '$count'"
if [[ ${#gpus[@]} -gt 0 && $count -gt ${#gpus[@]} ]]; then
    die "COUNT $count exceeds the ${#gpus[@]} GPU(s) available; one worker per GPU"
fi
cores=$(nproc 2>/dev/null || echo 1)

if [[ -z $host ]]; then
    for address in "${orchestrators[@]}"; do
        case $address in
            tcp://127.* | tcp://localhost:* | "tcp://[::1]":* | dns://localhost:*) ;;
            *) printf '%s: warning: no --host given, so the workers advertise 127.0.0.1; the orchestrator at %s cannot reach them unless it runs on this machine\n' "$PROG" "$address" >&2 ;;
        esac
    done
fi

# ------------------------------------------------------------------ pid files

mkdir -p -- "$log_dir" || die "cannot create log directory '$log_dir'"
log_dir=$(cd -- "$log_dir" && pwd)

for ((i = 0; i < count; i++)); do
    pid_file=$log_dir/$role-$i.pid
    [[ -e $pid_file ]] || continue
    old_pid=$(<"$pid_file")
    if [[ $old_pid =~ ^[0-9]+$ ]] && group_alive "$old_pid"; then
        printf '%s: error: %s-%d is already running (pid %s, %s); stop it first: deploy/stop-pool.sh --log-dir %q %s\n' \
            "$PROG" "$role" "$i" "$old_pid" "$pid_file" "$log_dir" "$role" >&2
        exit 1
    fi
    echo "removing stale pid file $pid_file (pid ${old_pid:-?} is gone)"
    rm -f -- "$pid_file"
done

# ------------------------------------------------------------------ launch

# start_one NAME PLACEMENT [VAR=VALUE...] -- ARG...: start "$python ARG..." (with those environment
# variables) leading a process group of its own, logging to DIR/NAME.log, its pid in DIR/NAME.pid.
start_one() {
    local name=$1 placement=$2 env_args=() log_file pid_file pid wait_ms
    shift 2
    while [[ $1 != -- ]]; do env_args+=("$1"); shift; done
    shift
    log_file=$log_dir/$name.log
    pid_file=$log_dir/$name.pid
    printf '=== %s start-pool: %s\n' "$(date '+%Y-%m-%dT%H:%M:%S%z')" "${env_args[*]:+${env_args[*]} }$python $*" >>"$log_file"
    # With job control on (set -m) the background job leads a process group of its own;
    # the inner shell writes its pid (the group's leader, so pid == pgid) and then
    # becomes the worker with exec.
    set -m
    # shellcheck disable=SC2016  # $$, $1 and $@ are the inner shell's, not ours
    env "${env_args[@]}" bash -c 'echo "$$" >"$1"; shift; exec "$@"' start-pool "$pid_file" \
        "$python" "$@" </dev/null >>"$log_file" 2>&1 &
    set +m
    for ((wait_ms = 0; wait_ms < 5000; wait_ms += 50)); do
        [[ -s $pid_file ]] && break
        sleep 0.05
    done
    [[ -s $pid_file ]] || { echo "$PROG: error: $name did not start; see $log_file" >&2; exit 1; }
    pid=$(<"$pid_file")
    started+=("$name")
    echo "started $name: pid $pid, $placement, log $log_file"
}

if [[ -n $cluster_keys ]]; then key_args=(--cluster-keys "$(cd -- "$cluster_keys" && pwd)"); else key_args=(--insecure-no-auth); fi
started=()

# The node store goes first, so that the engines' first prompts find it; one per machine.
if [[ -n $node_store_gib ]]; then
    store_pid_file=$log_dir/node-store-0.pid
    if [[ -s $store_pid_file ]] && group_alive "$(<"$store_pid_file")"; then
        echo "node store already running (pid $(<"$store_pid_file")) at $NODE_STORE_ADDRESS"
    else
        rm -f -- "$store_pid_file"
        start_one node-store-0 "$node_store_gib GiB of host memory at $NODE_STORE_ADDRESS" -- \
            -m kvroute node-store --host-kv-gib "$node_store_gib" --bind "$NODE_STORE_ADDRESS" "${key_args[@]}"
    fi
fi

base_args=(-m kvroute "$role-worker")
for address in "${orchestrators[@]}"; do base_args+=(--orchestrator "$address"); done
[[ -z $model ]] || base_args+=(--model "$model")
base_args+=("${key_args[@]}")
[[ -z $host ]] || base_args+=(--host "$host" --bind-host 0.0.0.0)
[[ -z $node_store_gib ]] || base_args+=(--node-store "$NODE_STORE_ADDRESS")

for ((i = 0; i < count; i++)); do
    args=("${base_args[@]}")
    env_args=()
    if [[ ${#gpus[@]} -gt 0 ]]; then
        env_args=("CUDA_VISIBLE_DEVICES=${gpus[$i]}")
        placement="GPU ${gpus[$i]}"
    else
        core=$((i % cores))
        args+=(--omp-threads-bind "$core")
        placement="CPU core $core"
    fi
    start_one "$role-$i" "$placement" "${env_args[@]}" -- "${args[@]}" "${extra[@]}"
done

# A worker that exits at once (bad flag, missing model, import error) is reported now.
sleep "$STARTUP_CHECK_SECONDS"
failed=0
for name in "${started[@]}"; do
    pid=$(<"$log_dir/$name.pid")
    if ! group_alive "$pid"; then
        failed=1
        echo "$PROG: error: $name (pid $pid) exited during start-up; last lines of $log_dir/$name.log:" >&2
        tail -n 15 -- "$log_dir/$name.log" | sed 's/^/    /' >&2
        rm -f -- "$log_dir/$name.pid"
    fi
done
if [[ $failed -ne 0 ]]; then
    echo "$PROG: some workers failed; stop the rest with: deploy/stop-pool.sh --log-dir $log_dir $role" >&2
    exit 1
fi

echo "started $count $role worker(s) registering with ${orchestrators[*]}; logs and pid files in $log_dir"
echo "stop them with: $REPO_ROOT/deploy/stop-pool.sh --log-dir $log_dir $role"
