#!/usr/bin/env bash
# `make compose-test`: the production docker-compose.yml built and run by a real Docker engine, on a machine
# that reaches package registries but no image registry (see docker-compose.test.yml for what is replaced).
#
#  1. starts dockerd if none answers (and stops it at the end);
#  2. builds a local Debian base image once (debootstrap; kept as crowdtrain-compose-base:bookworm);
#  3. builds the project's images on it, torch from this machine's CPU wheel through wheelhouse/;
#  4. brings the stack up (two parameter-server containers: --scale assimilator=2), registers a client
#     container, submits the example job with `exec`, restarts the parameter servers mid-run, waits for the
#     job to succeed and checks exact accounting inside the scheduler container;
#  5. tears down what it created: the project's containers, network and volumes, the wheel it put in
#     wheelhouse/, the dockerd it started. The images stay, as a build cache.
# Run as root (dockerd, debootstrap). Needs docker.io, docker-compose (1.29 or compose v2), debootstrap and
# curl: as root on Debian it installs those missing with apt-get first (COMPOSE_TEST_INSTALL=no forbids it);
# otherwise it names what is missing and how to install it, and exits 1 before anything is started.
# `compose-test.sh --prerequisites` does only that.
set -euo pipefail
cd "$(dirname "$0")/../.."

PROJECT=crowdtrain-compose-test
BASE_IMAGE=crowdtrain-compose-base:bookworm
PORTS=(15432 16379 19000 18000) # PostgreSQL, Redis, S3 (moto), scheduler: as in docker-compose.test.yml
SCHEDULER=http://127.0.0.1:18000
PIP=${PIP:-.venv/bin/pip}
PYTHON=${PYTHON:-.venv/bin/python} # with PyYAML
TIMINGS=()
STARTED_DOCKERD=

# Each command the test runs, and the Debian package that brings it.
declare -A PACKAGE_OF=([docker]=docker.io [dockerd]=docker.io [docker-compose]=docker-compose
    [debootstrap]=debootstrap [curl]=curl)

missing_commands() { # the commands above that this machine lacks, one a line
    local command
    for command in docker dockerd debootstrap curl; do
        # dockerd is not needed where an engine answers already (the test then uses it and stops nothing).
        if [ "$command" = dockerd ] && command -v docker >/dev/null && docker info >/dev/null 2>&1; then continue; fi
        command -v "$command" >/dev/null || echo "$command"
    done
    command -v docker-compose >/dev/null || { command -v docker >/dev/null && docker compose version >/dev/null 2>&1; } ||
        echo docker-compose
}

packages_of() { # the packages that bring the commands given, each once, in order
    local command package packages=()
    for command in "$@"; do
        package=${PACKAGE_OF[$command]}
        [[ " ${packages[*]} " == *" $package "* ]] || packages+=("$package")
    done
    echo "${packages[*]}"
}

check_prerequisites() { # install what is missing (root on Debian), or name it and exit 1
    local missing packages
    mapfile -t missing < <(missing_commands)
    [ "${#missing[@]}" -eq 0 ] && return
    packages=$(packages_of "${missing[@]}")
    if [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null &&
        [ "${COMPOSE_TEST_INSTALL:-yes}" != no ]; then
        echo "installing what make compose-test needs: $packages"
        apt-get update
        # shellcheck disable=SC2086 # one word per package
        DEBIAN_FRONTEND=noninteractive apt-get install -y $packages
        mapfile -t missing < <(missing_commands)
        [ "${#missing[@]}" -eq 0 ] && return
    fi
    {
        echo "make compose-test needs commands this machine lacks: ${missing[*]}"
        echo "install them as root on Debian or Ubuntu: apt-get install -y $(packages_of "${missing[@]}")"
        if [ "${COMPOSE_TEST_INSTALL:-yes}" = no ]; then
            echo "(COMPOSE_TEST_INSTALL=no: not installed here)"
        elif [ "$(id -u)" != 0 ]; then
            echo "(as root on Debian, make compose-test installs them itself; it needs root to run in any case)"
        fi
    } >&2
    exit 1
}

check_prerequisites
[ "${1:-}" = --prerequisites ] && exit 0

WORK=$(mktemp -d /tmp/crowdtrain-compose-test.XXXXXX)
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
# Every command runs on docker-compose.yml with the override, merged once by compose itself (`config`) and
# rid of the published ports, which an engine refuses beside host networking and an override cannot remove.
dc() { "${COMPOSE[@]}" -p "$PROJECT" -f "$WORK/compose.yml" --profile client "$@"; }

render_compose_file() {
    "${COMPOSE[@]}" -p "$PROJECT" --env-file "$WORK/.env" --profile client \
        -f docker-compose.yml -f tests/compose/docker-compose.test.yml config >"$WORK/merged.yml"
    "$PYTHON" - "$WORK/merged.yml" "$WORK/compose.yml" <<'PY'
import sys, yaml
compose = yaml.safe_load(open(sys.argv[1]))
for service in compose["services"].values():
    if service.get("network_mode") == "host":
        service.pop("ports", None)
yaml.safe_dump(compose, open(sys.argv[2], "w"), sort_keys=False)
PY
}

say() { printf '\n== %s: %s\n' "$(date -u +%H:%M:%S)" "$*"; }
timed() { # timed LABEL COMMAND...: run, and keep its duration for the summary
    local label=$1 t0=$SECONDS
    shift
    "$@"
    TIMINGS+=("$(printf '%-34s %4d s' "$label" $((SECONDS - t0)))")
}

teardown() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$rc" -ne 0 ] && [ -f "$WORK/compose.yml" ]; then
        say "FAILED (exit $rc); the last lines of each service's log"
        dc logs --no-color --tail 30 2>/dev/null || true
    fi
    say "tearing down"
    if [ -f "$WORK/compose.yml" ]; then dc down --volumes --remove-orphans --timeout 30 || true; fi
    rm -f wheelhouse/*.whl
    rm -rf "$WORK"
    if [ -n "$STARTED_DOCKERD" ]; then
        kill "$STARTED_DOCKERD" && while kill -0 "$STARTED_DOCKERD" 2>/dev/null; do sleep 1; done
    fi
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

start_dockerd() {
    docker info >/dev/null 2>&1 && return
    say "starting dockerd (log: var/compose-test/dockerd.log)"
    mkdir -p var/compose-test
    dockerd >var/compose-test/dockerd.log 2>&1 &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
    echo "dockerd did not start; see var/compose-test/dockerd.log" >&2
    return 1
}

build_base_image() {
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        echo "$BASE_IMAGE is already built (docker rmi $BASE_IMAGE to make it again)"
        return
    fi
    local rootfs=$WORK/rootfs
    # minbase and Python 3.11 with venv, as the Dockerfiles expect of a base; this machine's extra CA
    # certificates too, for pip's HTTPS through its proxy (PIP_CERT names the bundle).
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
        http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; return 1; }
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
    chroot "$rootfs" update-ca-certificates >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' \
        -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
}

fetch_torch_wheel() {
    # pip's configuration on this machine finds a local CPU build of torch; a CUDA one would be gigabytes.
    "$PIP" download --quiet torch==2.13.0 --no-deps --dest wheelhouse
    ls wheelhouse/torch-2.13.0+cpu-*.whl >/dev/null || {
        echo "no CPU torch wheel found by $PIP" >&2
        return 1
    }
}

build_tensorflow_client() { # the client's TensorFlow variant, built as an operator would, with this base
    docker build --network host --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
        --build-arg CLIENT_EXTRAS=client,tensorflow -f Dockerfile.client -t crowdtrain-client:tensorflow .
    docker run --rm --network none --entrypoint python crowdtrain-client:tensorflow -c \
        'import tensorflow, torch; print("tensorflow", tensorflow.__version__, "torch", torch.__version__)'
}

stack_up() {
    dc up -d --scale assimilator=2 scheduler assimilator transitioner
    wait_until 180 "the scheduler answered" curl -fs -o /dev/null "$SCHEDULER/v1/health"
}

secret() { python3 -c 'import secrets; print(secrets.token_urlsafe(24))'; }

write_env_file() {
    {
        echo "POSTGRES_PASSWORD=$(secret)"
        echo "MINIO_ROOT_USER=crowdtrain"
        echo "MINIO_ROOT_PASSWORD=$(secret)"
        echo "CROWDTRAIN_ADMIN_TOKEN=$(secret)"
        echo "CROWDTRAIN_JOIN_TOKEN=$(secret)"
        echo "SCHEDULER_WORKERS=2"
        echo "ASSIMILATOR_CONCURRENCY=1"
    } >"$WORK/.env"
}

job_field() { # job_field JOB_ID PYTHON_EXPRESSION_OF_st: one figure of /v1/jobs/JOB_ID, through the published API
    curl -fsS -H "Authorization: Bearer $ADMIN_TOKEN" "$SCHEDULER/v1/jobs/$1" |
        python3 -c "import json, sys; st = json.load(sys.stdin); print($2)"
}

wait_until() { # wait_until SECONDS WHAT COMMAND...
    local limit=$1 what=$2 t0=$SECONDS
    shift 2
    until "$@"; do
        [ $((SECONDS - t0)) -lt "$limit" ] || { echo "timed out after ${limit}s: $what" >&2; return 1; }
        sleep 2
    done
}

client_registered() {
    [ "$(curl -fs -H "Authorization: Bearer $ADMIN_TOKEN" "$SCHEDULER/v1/admin/hosts" |
        python3 -c 'import json, sys; print(len(json.load(sys.stdin)))')" -ge 1 ]
}
merged_at_least() { [ "$(job_field "$JOB_ID" 'st["assignments"].get("merged", 0)')" -ge "$1" ]; }
job_finished() {
    local status
    status=$(job_field "$JOB_ID" 'st["status"]')
    printf '   job %s: %s, %s merged\n' "$JOB_ID" "$status" "$(job_field "$JOB_ID" 'st["assignments"].get("merged", 0)')"
    [ "$status" != pending ] && [ "$status" != running ]
}

run_job() {
    say "registering a client container"
    dc up -d --no-deps client
    wait_until 120 "the client registered" client_registered
    dc exec -T scheduler crowdtrain admin host list

    say "submitting examples/mnist1d-cnn.yaml with exec"
    JOB_ID=$(dc exec -T scheduler crowdtrain job submit examples/mnist1d-cnn.yaml |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["job_id"])')
    echo "job $JOB_ID"

    wait_until 300 "3 merges" merged_at_least 3
    say "restarting the parameter-server containers mid-run"
    dc restart assimilator
    wait_until 600 "the job finished" job_finished
    [ "$(job_field "$JOB_ID" 'st["status"]')" = succeeded ] || {
        dc exec -T scheduler crowdtrain job status "$JOB_ID"
        return 1
    }
}

check_accounting() {
    dc stop client # no new results; what was uploaded must still be merged or rejected
    dc exec -T scheduler crowdtrain job status "$JOB_ID"
    dc exec -T scheduler python - "$JOB_ID" <tests/compose/check_accounting.py
}

backups() { # docs/operator/deploy.md's backup commands (Redis's with the test's port), and what each wrote is readable
    dc exec -T postgres pg_dump -U crowdtrain -Fc crowdtrain >"$WORK/crowdtrain.pgdump"
    dc exec -T postgres pg_restore --list <"$WORK/crowdtrain.pgdump" >"$WORK/pgdump.list"
    grep -q 'TABLE DATA public assignments' "$WORK/pgdump.list"
    dc exec -T redis sh -c 'redis-cli -p 16379 --rdb /data/backup.rdb >/dev/null && cat /data/backup.rdb' \
        >"$WORK/redis.rdb"
    [ "$(head -c 5 "$WORK/redis.rdb")" = REDIS ]
    ls -l "$WORK/crowdtrain.pgdump" "$WORK/redis.rdb"
}

for port in "${PORTS[@]}"; do
    if (: <"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "port $port is in use on this machine; docker-compose.test.yml needs it" >&2
        exit 1
    fi
done

say "Docker engine"
start_dockerd
echo "$("${COMPOSE[@]}" version --short) ($(command -v "${COMPOSE[0]}") ${COMPOSE[*]:1}), engine $(docker version -f '{{.Server.Version}}')"
say "local Debian base image"
timed "base image ($BASE_IMAGE)" build_base_image
write_env_file
render_compose_file
ADMIN_TOKEN=$(sed -n 's/^CROWDTRAIN_ADMIN_TOKEN=//p' "$WORK/.env")

say "building the images"
fetch_torch_wheel
timed "build crowdtrain-compose-backing" dc build postgres
timed "build crowdtrain-server" dc build scheduler
timed "build crowdtrain-client" dc build client
timed "build crowdtrain-client:tensorflow" build_tensorflow_client

say "bringing the stack up (2 parameter-server containers)"
timed "stack up (scheduler answering)" stack_up
dc ps
timed "job done (restart included)" run_job
timed "exact accounting" check_accounting
say "backups of PostgreSQL and Redis"
backups

say "images"
docker images --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E '^crowdtrain'
say "timings"
printf '%s\n' "${TIMINGS[@]}"
say "compose-test passed in $((SECONDS / 60)) min $((SECONDS % 60)) s"
