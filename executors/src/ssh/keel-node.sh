# keel-node.sh: the worker host's side of Keel's SSH executor (POSIX sh).
#
# The executor installs this file under its work directory on each host as
# keel-node-<hash>.sh (so hosts may hold several Keel versions' copies while
# old supervisors finish) and runs it over SSH, once per connection:
#
#   sh keel-node-<hash>.sh serve
#
# which then runs the executor's requests (see serve below), so a request
# costs a fork, not a login. `sh keel-node-<hash>.sh COMMAND ARGS...` runs
# one command directly.
#
# Each worker has a base path WORKERS/job-J/eE-rR (job, allocation epoch,
# rank: the worker's identity) and these files:
#   .log   the worker's stdout and stderr, written by `keel log-writer`
#          where keel is on the host: rotated (.log.START: the files rotated
#          out, named by the log's offset of their first byte), paused while
#          the disk is below its floor (.paused says why); else appended to
#          by the worker itself, unrotated;
#   .progress the worker's progress lines, copied aside by the log writer
#          (the executor follows it; a log rotated faster than it reads
#          loses none), rotated the same way;
#   .pid   "PID START PORT GPUS": the supervisor, which leads the worker's
#          process group and session; its kernel start time (so a reused pid
#          is never taken for it); the job's rendezvous port; its GPUs;
#   .exit  "CODE REASON", written by the supervisor when the worker ends;
#   .claim the pid of the agent that launched it, created exclusively: one
#          launch per identity, however many servers ask;
#   .cgroup the worker's cgroup, where the host lets Keel make one: every
#          process the worker starts is in it (a setsid does not leave it),
#          stopped with it, and gone before its exit is written.
# The supervisor runs in its own session (setsid), with no pipe to SSH, so
# the worker survives the SSH connection and the server that opened it.
set -u

# Sets st to the kernel start time of process $1, or fails when it does not
# run (a zombie does not). Builtins only: the poll runs this per worker.
start_time() {
    st=
    { read -r st < "/proc/$1/stat"; } 2> /dev/null || return 1
    st=${st##*) }
    # shellcheck disable=SC2086
    set -- $st
    [ "$1" != Z ] && [ "$1" != X ] || return 1
    shift 19
    st=$1
}

# Sets cg_parent to a cgroup directory Keel may make the workers' cgroups of
# work directory $1 in (cgroup v2 under this process's own cgroup, else
# v1's freezer), or fails with why in cg_why.
cgroup_parent() {
    w_dir=$1
    cg_parent= cg_why="no cgroup v2 or v1 freezer hierarchy is mounted"
    for want in cgroup2 freezer; do
        own=
        while IFS=: read -r c_id c_ctl c_path; do
            if [ "$want" = cgroup2 ] && [ "$c_id" = 0 ] && [ -z "$c_ctl" ]; then own=$c_path; fi
            case ",$c_ctl," in *",$want,"*) own=$c_path ;; esac
        done < /proc/self/cgroup
        [ -n "$own" ] || continue
        while read -r m_line; do
            case "$m_line" in
                *" - cgroup2 "*) [ "$want" = cgroup2 ] || continue ;;
                *" - cgroup "*[,\ ]freezer*) [ "$want" = freezer ] || continue ;;
                *) continue ;;
            esac
            # shellcheck disable=SC2086
            set -- $m_line
            dir="$5${own%/}/keel"
            if mkdir -p "$dir" 2> /dev/null; then
                cg_parent=$dir cg_kind=$want
                cg_tag="ssh$(printf '%s' "$w_dir" | cksum | cut -d' ' -f1)"
                return 0
            fi
            cg_why="cannot make $dir"
        done < /proc/self/mountinfo
    done
    return 1
}

# Sets lim_dir to the cgroup for the worker's $1 (memory or cpu) limit:
# its own cgroup $2 on v2 when the controller is delegated to Keel's, else
# one of the same name in v1's hierarchy of $1 (made); fails when none is
# writable.
limit_dir() {
    l_ctl=$1 l_own=$2 lim_dir=
    if [ "${cg_kind:-}" = cgroup2 ]; then
        l_parent=${l_own%/*}
        read -r l_have < "$l_parent/cgroup.controllers" 2> /dev/null || l_have=
        case " $l_have " in
            *" $l_ctl "*)
                echo "+$l_ctl" > "$l_parent/cgroup.subtree_control" 2> /dev/null
                read -r l_on < "$l_parent/cgroup.subtree_control" 2> /dev/null || l_on=
                case " $l_on " in *" $l_ctl "*)
                    lim_dir=$l_own
                    return 0
                    ;;
                esac
                ;;
        esac
    fi
    l_path=
    while IFS=: read -r c_id c_ctl c_path; do
        [ "$c_id" = 0 ] && continue
        case ",$c_ctl," in *",$l_ctl,"*) l_path=$c_path ;; esac
    done < /proc/self/cgroup
    [ -n "$l_path" ] || return 1
    while read -r m_line; do
        case "$m_line" in *" - cgroup "*) ;; *) continue ;; esac
        case ",${m_line##* }," in *",$l_ctl,"*) ;; *) continue ;; esac
        # shellcheck disable=SC2086
        set -- $m_line
        lim_dir="$5${l_path%/}/keel/${l_own##*/}"
        mkdir -p "$lim_dir" 2> /dev/null && return 0
    done < /proc/self/mountinfo
    lim_dir=
    return 1
}

# A byte count as a spec writes it (4Gi, 512Mi), else bytes.
show_memory() {
    for u in Ti:1099511627776 Gi:1073741824 Mi:1048576 Ki:1024; do
        if [ "$1" -ge "${u#*:}" ] && [ $(($1 % ${u#*:})) -eq 0 ]; then
            echo "$(($1 / ${u#*:}))${u%%:*}"
            return
        fi
    done
    echo "$1"
}

# Writes the worker's limits (KEEL_LIMIT_MEMORY_BYTES, KEEL_LIMIT_CPU_MILLIS,
# from its launch) for its cgroup $1 (empty: it has none). Sets lim_enter
# to the other cgroups the worker enters (v1's) and lim_mem to where its
# memory is counted; what cannot be enforced, the worker's log says.
apply_limits() {
    lim_enter= lim_mem=
    if [ -n "${KEEL_LIMIT_MEMORY_BYTES:-}" ]; then
        ok=
        if [ -n "$1" ] && limit_dir memory "$1"; then
            if [ -f "$lim_dir/memory.max" ]; then
                echo "$KEEL_LIMIT_MEMORY_BYTES" > "$lim_dir/memory.max" 2> /dev/null && ok=1
                echo 0 > "$lim_dir/memory.swap.max" 2> /dev/null
            elif echo "$KEEL_LIMIT_MEMORY_BYTES" > "$lim_dir/memory.limit_in_bytes" 2> /dev/null; then
                ok=1
                echo "$KEEL_LIMIT_MEMORY_BYTES" > "$lim_dir/memory.memsw.limit_in_bytes" 2> /dev/null
            fi
        fi
        if [ -n "$ok" ]; then
            lim_mem=$lim_dir lim_mem_bytes=$KEEL_LIMIT_MEMORY_BYTES
            [ "$lim_dir" = "$1" ] || lim_enter="$lim_enter $lim_dir"
        else
            echo "keel: resources.memory ($(show_memory "$KEEL_LIMIT_MEMORY_BYTES")) is not enforced on this node: no writable memory cgroup controller" >&2
        fi
    fi
    if [ -n "${KEEL_LIMIT_CPU_MILLIS:-}" ]; then
        ok=
        quota=$((KEEL_LIMIT_CPU_MILLIS * 100))
        if [ -n "$1" ] && limit_dir cpu "$1"; then
            if [ -f "$lim_dir/cpu.max" ]; then
                echo "$quota 100000" > "$lim_dir/cpu.max" 2> /dev/null && ok=1
            elif echo 100000 > "$lim_dir/cpu.cfs_period_us" 2> /dev/null &&
                echo "$quota" > "$lim_dir/cpu.cfs_quota_us" 2> /dev/null; then
                ok=1
            fi
        fi
        if [ -n "$ok" ]; then
            [ "$lim_dir" = "$1" ] || lim_enter="$lim_enter $lim_dir"
        else
            echo "keel: resources.cpus ($KEEL_LIMIT_CPU_MILLIS thousandths) is not enforced on this node: no writable cpu cgroup controller" >&2
        fi
    fi
    unset KEEL_LIMIT_MEMORY_BYTES KEEL_LIMIT_CPU_MILLIS
}

# How many times the kernel killed a process in memory cgroup $1 for
# memory (0 without one).
oom_kills() {
    o_n=0
    if [ -n "$1" ]; then
        for f in "$1/memory.events" "$1/memory.oom_control"; do
            [ -f "$f" ] || continue
            while read -r o_k o_v; do
                [ "$o_k" = oom_kill ] && o_n=$o_v
            done < "$f"
        done
    fi
    echo "$o_n"
}

# Signals every process in cgroup $2 with $1 (KILL: at once, with
# cgroup.kill where the kernel has it, else frozen so none can fork).
cgroup_signal() {
    if [ "$1" = KILL ]; then
        echo 1 > "$2/cgroup.kill" 2> /dev/null && return 0
        frozen=
        if [ -f "$2/freezer.state" ]; then
            echo FROZEN > "$2/freezer.state" 2> /dev/null && frozen="freezer.state THAWED"
        else
            echo 1 > "$2/cgroup.freeze" 2> /dev/null && frozen="cgroup.freeze 0"
        fi
    fi
    while read -r c_pid; do
        kill -s "$1" "$c_pid" 2> /dev/null
    done < "$2/cgroup.procs"
    if [ -n "${frozen:-}" ]; then
        # shellcheck disable=SC2086
        set -- "$2" $frozen
        echo "$3" > "$1/$2" 2> /dev/null
    fi
}

# Whether cgroup $1 still holds a process.
cgroup_busy() {
    { read -r _ < "$1/cgroup.procs"; } 2> /dev/null
}

# Stops what the worker left in cgroup $1: SIGTERM, up to $2 tenths of a
# second, then kills until it is empty; removes it. Says what it stopped.
cgroup_drain() {
    cgroup_busy "$1" || { rmdir "$1" 2> /dev/null; return 0; }
    left=0
    while read -r _; do left=$((left + 1)); done < "$1/cgroup.procs"
    cgroup_signal TERM "$1"
    i=0
    while cgroup_busy "$1" && [ "$i" -lt "$2" ]; do
        sleep 0.1
        i=$((i + 1))
    done
    i=0
    while cgroup_busy "$1" && [ "$i" -lt 300 ]; do
        cgroup_signal KILL "$1"
        sleep 0.1
        i=$((i + 1))
    done
    rmdir "$1" 2> /dev/null
    echo "keel: stopped $left process(es) the worker left running" >&2
}

# Whether the supervisor recorded in $1.pid still runs.
alive() {
    [ -f "$1.pid" ] || return 1
    read -r a_pid a_start _ < "$1.pid" || return 1
    start_time "$a_pid" && [ "$st" = "$a_start" ]
}

# Sets r_list to the starts of stream $1's rotated files (its files
# $1.START), r_max and r_min to the greatest and least (empty with none).
rotated_list() {
    r_list= r_max= r_min=
    for r_f in "$1".[0-9]*; do
        [ -f "$r_f" ] || continue
        r_s=${r_f##*.}
        case $r_s in *[!0-9]*) continue ;; esac
        r_list="$r_list $r_s"
        if [ -z "$r_max" ] || [ "$r_s" -gt "$r_max" ]; then r_max=$r_s; fi
        if [ -z "$r_min" ] || [ "$r_s" -lt "$r_min" ]; then r_min=$r_s; fi
    done
}

# Sets s_total to stream $1's length (every byte ever written to it),
# s_start to where its current file $1 starts (where the newest rotated
# file ends), s_first to its first offset still on disk. Listed again
# until no rotation came between the listing and the current file's size.
stream_len() {
    rotated_list "$1"
    while :; do
        s_before=$r_list
        s_cur=$({ wc -c < "$1"; } 2> /dev/null) || s_cur=0
        s_last=0
        [ -z "$r_max" ] || s_last=$({ wc -c < "$1.$r_max"; } 2> /dev/null) || s_last=0
        rotated_list "$1"
        [ "$r_list" = "$s_before" ] && break
    done
    s_start=0
    [ -z "$r_max" ] || s_start=$((r_max + s_last))
    s_total=$((s_start + s_cur))
    s_first=${r_min:-$s_start}
}

# stream_read STREAM OFFSET N: writes up to N bytes of the stream from
# OFFSET (at least s_first), across its files in order.
stream_read() {
    sr_s=$1 sr_at=$2 sr_n=$3
    stream_len "$sr_s"
    while [ "$sr_n" -gt 0 ]; do
        # The file holding sr_at: the current one, or the rotated one with
        # the greatest start not after it.
        sr_f= sr_from=-1
        if [ "$s_start" -le "$sr_at" ]; then
            sr_f=$sr_s sr_from=$s_start
        else
            for r_s in $r_list; do
                if [ "$r_s" -le "$sr_at" ] && [ "$r_s" -gt "$sr_from" ]; then
                    sr_f=$sr_s.$r_s sr_from=$r_s
                fi
            done
        fi
        [ -n "$sr_f" ] || return 0
        sr_len=$({ wc -c < "$sr_f"; } 2> /dev/null) || return 0
        sr_take=$((sr_from + sr_len - sr_at))
        [ "$sr_take" -gt "$sr_n" ] && sr_take=$sr_n
        [ "$sr_take" -gt 0 ] || return 0
        tail -c "+$((sr_at - sr_from + 1))" "$sr_f" | head -c "$sr_take"
        sr_at=$((sr_at + sr_take))
        sr_n=$((sr_n - sr_take))
    done
}

# Whether the `keel` on the PATH writes logs (`keel log-writer`): the one
# the executor installed, or the host's own; not a stand-in of that name.
log_writer_here() {
    [ "$(keel log-writer --probe 2> /dev/null)" = "keel-log-writer 1" ]
}

# The worker's umask: the host's, as this helper found it (see the end of
# this file), not the 077 the helper writes its own files under.
worker_umask() {
    umask "${KEEL_WORKER_UMASK:-022}"
    unset KEEL_WORKER_UMASK
}

# supervise BASE PORT GPUS CMD...: run CMD, record its end in BASE.exit.
supervise() {
    base=$1 port=$2 gpus=$3
    shift 3
    # The group's SIGTERM is for the worker (checkpoint and exit); the
    # supervisor stays to record the exit.
    trap ':' TERM
    start_time $$ || st=0
    printf '%s %s %s %s\n' $$ "$st" "$port" "$gpus" > "$base.pid.tmp" &&
        mv -f "$base.pid.tmp" "$base.pid"
    # The worker's output, and this supervisor's, goes through keel's log
    # writer when launch chose it (it made the progress stream): rotated,
    # progress lines copied aside, paused below the free-space floor. In a
    # session of its own, outside the worker's cgroup: the worker's signals
    # and its cgroup's end are not for it; it ends at its input's end.
    writer=
    if [ -f "$base.progress" ] && lw=$(command -v keel) && rm -f "$base.fifo" &&
        mkfifo "$base.fifo" 2> /dev/null; then
        setsid "$lw" log-writer --log "$base.log" \
            --log-max-file-bytes "${KEEL_LOG_MAX_FILE_BYTES:-10485760}" \
            --log-max-files "${KEEL_LOG_MAX_FILES:-5}" \
            --log-min-free-bytes "${KEEL_LOG_MIN_FREE_BYTES:-0}" \
            < "$base.fifo" > /dev/null 2>&1 &
        writer=$!
        exec > "$base.fifo" 2>&1
        rm -f "$base.fifo"
    else
        # Without the log writer, the poll reads progress from the log.
        rm -f "$base.progress"
        echo "keel: this host has no keel log writer on its PATH: the worker's log is not rotated" >&2
    fi
    [ -z "${KEEL_LOG_NOTE:-}" ] || echo "keel: $KEEL_LOG_NOTE" >&2
    unset KEEL_LOG_MAX_FILE_BYTES KEEL_LOG_MAX_FILES KEEL_LOG_MIN_FREE_BYTES KEEL_LOG_NOTE
    if ! command -v "$1" > /dev/null 2>&1; then
        echo "keel: could not start \"$1\": not found" >&2
        printf '127 could not start "%s": not found\n' "$1" > "$base.exit.tmp"
        mv -f "$base.exit.tmp" "$base.exit"
        exit 127
    fi
    # The worker's own cgroup, entered before its command runs.
    cg=
    if cgroup_parent "${base%/*/*}"; then
        # jJ-eE-rR, from WORKERS/job-J/eE-rR.
        j=${base%/*}
        cg="$cg_parent/$cg_tag-j${j##*/job-}-${base##*/}"
        if mkdir -p "$cg" 2> /dev/null; then
            printf '%s\n' "$cg" > "$base.cgroup"
        else
            echo "keel: the worker runs without a cgroup: cannot make $cg" >&2
            cg=
        fi
    else
        echo "keel: the worker runs without a cgroup ($cg_why): a process it starts with setsid escapes it" >&2
    fi
    apply_limits "$cg"
    if [ -n "$cg" ]; then
        (
            echo 0 > "$cg/cgroup.procs" || exit 127
            for d in $lim_enter; do
                echo 0 > "$d/cgroup.procs" || {
                    echo "keel: cannot enter the cgroup $d" >&2
                    exit 127
                }
            done
            worker_umask
            exec "$@"
        ) &
    else
        (
            worker_umask
            exec "$@"
        ) &
    fi
    child=$!
    while :; do
        wait "$child"
        code=$?
        # A signal to the supervisor interrupts wait; the worker goes on.
        kill -0 "$child" 2> /dev/null || break
    done
    ooms=$(oom_kills "$lim_mem")
    if [ -n "$cg" ]; then
        cgroup_drain "$cg" "${KEEL_LEFTOVER_GRACE_DS:-100}"
        for d in $lim_enter; do
            i=0
            while ! rmdir "$d" 2> /dev/null && [ -d "$d" ] && [ "$i" -lt 50 ]; do
                i=$((i + 1))
                sleep 0.02
            done
        done
    fi
    if [ "$code" -gt 128 ] && name=$(kill -l "$((code - 128))" 2> /dev/null); then
        reason="killed by SIG$name (status $code)"
    else
        reason="exited with code $code"
    fi
    if [ "$code" -ne 0 ] && [ "$ooms" -gt 0 ]; then
        reason="out of memory: over its limit of $(show_memory "$lim_mem_bytes") ($reason)"
    fi
    # The last of the output is in the log before the exit is recorded (up
    # to 2 s: a process that escaped a worker with no cgroup may hold the
    # pipe open for ever).
    if [ -n "$writer" ]; then
        exec > /dev/null 2>&1
        i=0
        while start_time "$writer" && [ "$i" -lt 200 ]; do
            sleep 0.01
            i=$((i + 1))
        done
    fi
    printf '%s %s\n' "$code" "$reason" > "$base.exit.tmp"
    mv -f "$base.exit.tmp" "$base.exit"
    exit "$code"
}

# Prints "GPU I busy: pid P (NAME)" for each process nvidia-smi lists on
# GPUs $1 (comma-separated; - none, * all) that belongs to no Keel job, or
# to another than $2 (the worker's own job's space-sharing partner, or
# empty; * any job); nothing where nvidia-smi is not installed or cannot
# answer. `busy` (for the node's note) lists those of no job on any GPU.
gpus_busy() {
    [ "$1" != - ] || return 0
    command -v nvidia-smi > /dev/null 2>&1 || return 0
    b_uuids=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2> /dev/null) || return 0
    b_apps=$(nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name --format=csv,noheader 2> /dev/null) || return 0
    printf '%s\n' "$b_apps" | while IFS=, read -r a_uuid a_pid a_name; do
        a_uuid=${a_uuid# } a_pid=${a_pid# } a_name=${a_name# }
        case $a_pid in '' | *[!0-9]*) continue ;; esac
        a_index=$(printf '%s\n' "$b_uuids" | while IFS=, read -r u_index u_uuid; do
            [ "${u_uuid# }" = "$a_uuid" ] && echo "$u_index"
        done)
        case ",$1," in *",$a_index,"* | ",*,") ;; *) continue ;; esac
        a_job=$(tr '\0' '\n' < "/proc/$a_pid/environ" 2> /dev/null | sed -n 's/^KEEL_JOB_ID=//p')
        if [ -z "$a_job" ] || { [ "$2" != '*' ] && [ "$a_job" != "$2" ]; }; then
            echo "GPU $a_index busy: pid $a_pid ($a_name)"
        fi
    done
}

# launch BASE CHECKPOINT_DIR PORT GPUS N NAME=VALUE... CMD...: start CMD,
# with the N variables in its environment, under a supervisor in a new
# session, unless the worker already runs; prints the log's size before the
# start and returns once the supervisor has written its pid file (or its
# exit). A GPU of the worker that another process uses (gpus_busy) starts
# nothing: a second line "N GPU I busy: ..." says why.
launch() {
    base=$1 ckpt=$2 l_port=$3 l_gpus=$4 n=$5
    shift 5
    while [ "$n" -gt 0 ]; do
        export "$1"
        shift
        n=$((n - 1))
    done
    # The keel the executor installed here, first on the PATH (job files
    # run `keel trainer`).
    if [ -n "${KEEL_BIN_DIR:-}" ]; then
        PATH="$KEEL_BIN_DIR:$PATH"
        export PATH
    fi
    set -- "$l_port" "$l_gpus" "$@"
    mkdir -p "${base%/*}" "$ckpt" || exit 1
    # Where the follower of this run's progress starts: in the progress
    # stream when keel's log writer is here (made now, so the poll reads
    # it from the first line, and the supervisor writes through the log
    # writer because it exists), else in the log.
    if [ -f "$base.progress" ] || { ! alive "$base" && log_writer_here; }; then
        : >> "$base.progress"
        stream_len "$base.progress"
    else
        stream_len "$base.log"
    fi
    echo "$s_total"
    if alive "$base"; then
        exit 0
    fi
    # A GPU another process uses is refused: "N WHY" (not admitted), and
    # nothing starts.
    busy=$(gpus_busy "$l_gpus" "${KEEL_SHARED_WITH_JOB:-}")
    if [ -n "$busy" ]; then
        echo "N $(printf '%s' "$busy" | tr '\n' ';')"
        exit 0
    fi
    # One launch per worker, whichever server asks: the claim is created
    # exclusively (noclobber). A stale leader woken from a pause finds the
    # new leader's claim and starts nothing; a worker that ended keeps its
    # exit record for the poll instead of being started again. A claim
    # without a pid or exit record whose agent is gone (it died between
    # the claim and the start) is taken over.
    if ! (set -C && echo "$$" > "$base.claim") 2> /dev/null; then
        if [ -f "$base.pid" ] || [ -f "$base.exit" ]; then
            exit 0
        fi
        read -r c_pid < "$base.claim" 2> /dev/null || c_pid=
        if [ -n "$c_pid" ] && [ "$c_pid" != "$$" ] && kill -0 "$c_pid" 2> /dev/null; then
            exit 0
        fi
        rm -f "$base.claim"
        (set -C && echo "$$" > "$base.claim") 2> /dev/null || exit 0
    fi
    rm -f "$base.exit" "$base.pid"
    command -v setsid > /dev/null 2>&1 || {
        echo "setsid is not installed on this host (util-linux)" >&2
        exit 3
    }
    setsid sh "$0" supervise "$base" "$@" < /dev/null >> "$base.log" 2>&1 &
    i=0
    while [ ! -f "$base.pid" ] && [ ! -f "$base.exit" ]; do
        i=$((i + 1))
        if [ "$i" -gt 1000 ]; then
            echo "the supervisor did not start within 10 s" >&2
            exit 1
        fi
        sleep 0.01
    done
}

# poll WORKERS [F:BASE | R:BASE | BASE:OFFSET | BASE:end]...: first forgets
# each F:BASE (its exit and pid records: the exit is in the log) and
# releases each R:BASE (those and its claim: stopped by a shutdown, to be
# launched again by the next leader), then prints
# one line per worker found ("R BASE PORT GPUS" running, "X BASE CODE
# REASON" exited, "G BASE" gone without an exit record), then for each
# BASE:OFFSET the log's bytes from OFFSET (at most 256 KiB): "P BASE OFFSET
# LEN" followed by exactly LEN bytes; BASE:end gives "P BASE SIZE 0", where
# a follower that starts now starts. "END" last. Listing forks nothing.
# The bytes are the progress stream's where the worker has one, else its
# log's; OFFSET is later than asked when rotation took what was there.
poll() {
    cd "$1" 2> /dev/null || {
        echo END
        exit 0
    }
    shift
    for req in "$@"; do
        case $req in
            F:*) rm -f "${req#F:}.exit" "${req#F:}.pid" "${req#F:}.cgroup" ;;
            R:*) rm -f "${req#R:}.exit" "${req#R:}.pid" "${req#R:}.claim" "${req#R:}.cgroup" ;;
        esac
    done
    last=
    for f in job-*/e*-r*.*; do
        case $f in
            *.pid | *.exit) ;;
            *) continue ;;
        esac
        b=${f%.*}
        [ "$b" = "$last" ] && continue
        last=$b
        # Running first, then the exit record: a supervisor found gone has
        # written its record, if it wrote one, before this looks for it.
        if alive "$b"; then
            read -r _ _ port gpus < "$b.pid"
            echo "R $b $port $gpus"
        elif [ -f "$b.exit" ]; then
            IFS= read -r rec < "$b.exit"
            echo "X $b $rec"
        elif [ -f "$b.pid" ]; then
            # Its supervisor is gone without a record (killed with the
            # worker); what the worker started may not be: killed by its
            # cgroup, and reported running until the cgroup is empty, so
            # its GPUs are not handed on beside it.
            g_cg=
            read -r g_cg < "$b.cgroup" 2> /dev/null
            if [ -n "$g_cg" ] && [ -d "$g_cg" ] && cgroup_busy "$g_cg"; then
                cgroup_signal KILL "$g_cg"
                read -r _ _ port gpus < "$b.pid"
                echo "R $b $port $gpus"
            else
                [ -z "$g_cg" ] || rmdir "$g_cg" 2> /dev/null
                echo "G $b"
            fi
        fi
    done
    for req in "$@"; do
        case $req in
            F:*) continue ;;
        esac
        b=${req%:*}
        off=${req##*:}
        s=$b.log
        [ -f "$b.progress" ] && s=$b.progress
        [ -f "$s" ] || continue
        stream_len "$s"
        if [ "$off" = end ]; then
            echo "P $b $s_total 0"
            continue
        fi
        [ "$off" -lt "$s_first" ] && off=$s_first
        n=$((s_total - off))
        [ "$n" -gt 262144 ] && n=262144
        [ "$n" -gt 0 ] || continue
        emit_exactly "P $b $off" stream_read "$s" "$off" "$n"
    done
    echo END
}

# emit_exactly HEAD CMD ARG1 ARG2 ARG3 [TRAILER]: runs CMD with the three
# arguments and prints "HEAD LEN" then its LEN bytes of output (a file may
# be rotated away while it is read: the count is what was read, never what
# was expected); with TRAILER, "HEAD LEN TLEN", then TRAILER's TLEN bytes.
emit_exactly() {
    e_head=$1
    shift
    e_tmp=${TMPDIR:-/tmp}/keel-node.$$.read
    "$1" "$2" "$3" "$4" > "$e_tmp"
    e_n=$(wc -c < "$e_tmp")
    if [ -n "${5:-}" ]; then
        e_t=$(printf '%s' "$5" | wc -c)
        echo "$e_head $((e_n)) $((e_t))"
        cat "$e_tmp"
        printf '%s' "$5"
    else
        echo "$e_head $((e_n))"
        cat "$e_tmp"
    fi
    rm -f "$e_tmp"
}

# signal SIGNAL BASE: signal the worker's process group, if it runs. KILL
# spares the supervisor, so that it records the worker's end; the group's
# members are found in /proc (no procps needed).
signal() {
    alive "$2" || exit 0
    read -r s_pid _ < "$2.pid"
    # Every process of the worker, the ones that left its session too.
    if read -r s_cg < "$2.cgroup" 2> /dev/null && [ -d "$s_cg" ]; then
        cgroup_signal "$1" "$s_cg"
    fi
    if [ "$1" = KILL ]; then
        for d in /proc/[0-9]*; do
            p=${d#/proc/}
            [ "$p" = "$s_pid" ] && continue
            { read -r s < "$d/stat"; } 2> /dev/null || continue
            s=${s##*) }
            # shellcheck disable=SC2086
            set -- $s
            [ "$3" = "$s_pid" ] && kill -s KILL "$p" 2> /dev/null
        done
        return 0
    fi
    kill -s "$1" -- "-$s_pid" 2> /dev/null || kill -s "$1" "$s_pid" 2> /dev/null || true
}

# logs WORKERS JOB TAIL_BYTES: "L NAME SIZE LEN [WHY_LEN]" then exactly LEN
# bytes (the log's end, across its rotated files; SIZE counts every byte
# written), then WHY_LEN bytes saying why the log is paused (while it is),
# for each log of the job on this host.
logs() {
    cd "$1/$2" 2> /dev/null || exit 0
    for f in e*-r*.log; do
        [ -f "$f" ] || continue
        stream_len "$f"
        n=$3
        from=$((s_total - n))
        [ "$from" -lt "$s_first" ] && from=$s_first
        why=
        [ -f "${f%.log}.paused" ] && why=$(head -c 1000 "${f%.log}.paused")
        emit_exactly "L $f $s_total" stream_read "$f" "$from" "$((s_total - from))" "$why"
    done
}

# remove_logs WORKERS JOB: removes the job's files on this host (its
# logs; its workers have ended) unless one of its workers still runs
# there ("running"); else prints "FILES BYTES" removed.
remove_logs() {
    cd "$1" 2> /dev/null || {
        echo "0 0"
        exit 0
    }
    [ -d "$2" ] || {
        echo "0 0"
        exit 0
    }
    for p in "$2"/e*-r*.pid; do
        [ -f "$p" ] || continue
        if alive "${p%.pid}"; then
            echo running
            exit 0
        fi
    done
    r_files=0 r_bytes=0
    for f in "$2"/*; do
        [ -f "$f" ] || continue
        r_files=$((r_files + 1))
        r_bytes=$((r_bytes + $(wc -c < "$f")))
    done
    rm -rf "$2"
    echo "$r_files $r_bytes"
}

# probe: what a node needs, whether its workers get cgroups ("K cgroup", or
# "K none WHY"), and its GPUs when asked ("probe gpus").
probe() {
    command -v setsid > /dev/null 2>&1 || {
        echo "setsid is not installed on this host (util-linux)" >&2
        exit 3
    }
    if cgroup_parent probe; then
        echo "K cgroup"
    else
        echo "K none $cg_why"
    fi
    if command -v nvidia-smi > /dev/null 2>&1; then
        echo "K nvidia-smi"
    fi
    if [ "${1:-}" = gpus ]; then
        command -v nvidia-smi > /dev/null 2>&1 || {
            echo "nvidia-smi is not installed on this host: declare the node's gpus in the nodes file" >&2
            exit 3
        }
        # A GPU the driver lost makes nvidia-smi exit non-zero and say so
        # ("Unable to determine the device handle for GPU ..."), listing
        # the others: that is an answer, not a failure.
        g_out=$(nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv,noheader 2>&1)
        g_st=$?
        case $g_out in
            *"Unable to determine the device handle"*) g_st=0 ;;
        esac
        if [ "$g_st" -ne 0 ]; then
            printf '%s\n' "$g_out" >&2
            return "$g_st"
        fi
        printf '%s\n' "$g_out"
    fi
}

# serve: runs requests read from stdin, one per line: "ID WORDS", where
# WORDS are a command and its arguments quoted for the shell (a newline
# inside an argument is written '"$nl"'). Each is answered with a line
# "@@ ID STATUS OUT_LEN ERR_LEN" followed by exactly OUT_LEN bytes of its
# stdout and ERR_LEN bytes of its stderr. Ends at the end of its input.
serve() {
    # shellcheck disable=SC2034
    nl='
'
    tmp=${TMPDIR:-/tmp}/keel-node.$$
    trap 'rm -f "$tmp.out" "$tmp.err"' EXIT
    while IFS= read -r line; do
        id=${line%% *}
        words=${line#* }
        (eval "set -- $words" && dispatch "$@") < /dev/null > "$tmp.out" 2> "$tmp.err"
        rc=$?
        o=$(wc -c < "$tmp.out")
        e=$(wc -c < "$tmp.err")
        echo "@@ $id $rc $((o)) $((e))"
        cat "$tmp.out" "$tmp.err"
    done
}

dispatch() {
    cmd=$1
    shift
    case $cmd in
        supervise | launch | poll | signal | logs | remove_logs | probe | serve) "$cmd" "$@" ;;
        forget) rm -f "$1.exit" "$1.pid" "$1.cgroup" ;;
        busy) gpus_busy '*' '*' ;;
        *)
            echo "keel-node.sh: unknown command $cmd" >&2
            exit 2
            ;;
    esac
}

# What this helper writes (work directories, worker logs, progress streams,
# exit records, checkpoint directories) is the connecting user's alone. The
# host's own umask is kept for the workers (`worker_umask`), across the
# helper's own re-executions (the supervisor is this script run again).
: "${KEEL_WORKER_UMASK:=$(umask)}"
export KEEL_WORKER_UMASK
umask 077

dispatch "$@"
