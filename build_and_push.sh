#!/usr/bin/env bash
# Build the LLaVA session image (Dockerfile) and push it to Amazon ECR. See --help.
set -euo pipefail

readonly PROG="build_and_push.sh"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
readonly DOCKERFILE="${SCRIPT_DIR}/Dockerfile"

# Validation patterns (ECR repository names, Docker tags, AWS regions and account ids).
readonly REPOSITORY_RE='^([a-z0-9]+([._-][a-z0-9]+)*/)*[a-z0-9]+([._-][a-z0-9]+)*$'
readonly TAG_RE='^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$'
readonly REGION_RE='^[a-z]{2}(-gov|-iso[a-z]*)?-[a-z]+-[0-9]+$'
readonly ACCOUNT_RE='^[0-9]{12}$'
readonly BUILD_ARG_RE='^[A-Za-z_][A-Za-z0-9_]*=.*$'
readonly PLATFORM_RE='^[a-z0-9]+/[a-z0-9]+(/[a-z0-9]+)?$'
readonly ECR_IMAGE_RE='^([0-9]{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?/'

usage() {
    cat <<'EOF'
Usage: build_and_push.sh [options]

Build the GPU image from ./Dockerfile and push it to Amazon ECR:
  1. create the ECR repository if it does not exist (scan on push),
  2. log Docker in to the base image's registry when it is an AWS Deep Learning Container
     (ECR), and to the target registry,
  3. docker build, docker tag, docker push; the last line printed is the image URI
     (give it to llava-deploy --image-uri).

Options:
  --repository NAME     ECR repository (default: llava-sessions)
  --tag TAG             image tag (default: the git commit, short, + "-dirty" if the tree has
                        changes; "latest" outside git)
  --base-image URI      BASE_IMAGE build argument (default: the Dockerfile's ARG BASE_IMAGE)
  --region REGION       AWS region to push to (default: $AWS_REGION, $AWS_DEFAULT_REGION,
                        else `aws configure get region`)
  --account ID          12-digit AWS account id (default: `aws sts get-caller-identity`)
  --platform PLATFORM   docker build --platform (default: linux/amd64, SageMaker's GPU hosts)
  --build-arg KEY=VALUE extra build argument, repeatable, e.g.
                        --build-arg BAKE_MODEL_ID=llava-hf/llava-1.5-7b-hf
                        --build-arg BAKE_MODEL_REVISION=<40-hex commit>
  --hf-token-file FILE  Hugging Face token for a gated BAKE_MODEL_ID (BuildKit secret hf_token)
  --dry-run             print every command instead of running it; calls neither aws nor
                        docker (so --region, or AWS_REGION, must be given; without
                        --account the commands show ACCOUNT_ID in its place)
  -h, --help            show this help

Options take their value as the next argument or after "=" (--tag=v1).
EOF
}

die() {
    printf '%s: %s\n' "${PROG}" "$*" >&2
    exit 2
}

# ---- arguments ---------------------------------------------------------------------------------

repository="llava-sessions"
tag=""
base_image=""
region=""
account=""
platform="linux/amd64"
hf_token_file=""
dry_run=0
build_args=()

while (($#)); do
    arg="$1"
    shift
    case "${arg%%=*}" in
        -h | --help | --dry-run | --repository | --tag | --base-image | --region | --account | --platform | \
            --build-arg | --hf-token-file) ;;
        *) die "unknown argument: ${arg} (see --help)" ;;
    esac
    case "${arg}" in
        -h | --help)
            usage
            exit 0
            ;;
        --dry-run)
            dry_run=1
            continue
            ;;
        --*=*)
            name="${arg%%=*}"
            val="${arg#*=}"
            ;;
        --*)
            name="${arg}"
            (($#)) || die "${arg} needs a value (see --help)"
            val="$1"
            shift
            ;;
        *) die "unexpected argument: ${arg} (see --help)" ;;
    esac
    case "${name}" in
        --repository) repository="${val}" ;;
        --tag) tag="${val}" ;;
        --base-image) base_image="${val}" ;;
        --region) region="${val}" ;;
        --account) account="${val}" ;;
        --platform) platform="${val}" ;;
        --build-arg) build_args+=("${val}") ;;
        --hf-token-file) hf_token_file="${val}" ;;
        *) die "unknown option: ${name} (see --help)" ;;
    esac
done

# ---- defaults (only for what was not given) -------------------------------------------------------

need() {
    command -v "$1" >/dev/null 2>&1 || die "$1 not found on PATH; $2"
}

if [[ -z "${base_image}" ]]; then
    base_image="$(sed -n 's/^ARG BASE_IMAGE=//p' "${DOCKERFILE}" | head -n 1)"
    [[ -n "${base_image}" ]] || die "no ARG BASE_IMAGE=... default in ${DOCKERFILE}; pass --base-image"
fi
if [[ -z "${tag}" ]]; then
    if git -C "${SCRIPT_DIR}" rev-parse --git-dir >/dev/null 2>&1 \
        && commit="$(git -C "${SCRIPT_DIR}" rev-parse --short=12 HEAD 2>/dev/null)"; then
        tag="${commit}"
        if [[ -n "$(git -C "${SCRIPT_DIR}" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
            tag="${tag}-dirty"
        fi
    else
        tag="latest"
    fi
fi
if [[ -z "${region}" ]]; then
    region="${AWS_REGION:-${AWS_DEFAULT_REGION:-}}"
fi
if [[ -z "${region}" ]]; then
    ((dry_run == 0)) || die "--dry-run calls no aws: give --region (or set AWS_REGION)"
    need aws "install the AWS CLI v2 or pass --region"
    region="$(aws configure get region || true)"
    [[ -n "${region}" ]] || die "no region: pass --region, set AWS_REGION, or run aws configure"
fi
account_placeholder=0
if [[ -z "${account}" && dry_run -eq 1 ]]; then
    # a dry run calls no aws: show the account sts would name as a placeholder
    account="ACCOUNT_ID"
    account_placeholder=1
    echo "${PROG}: dry run: ACCOUNT_ID stands for your account id (aws sts get-caller-identity names it)" >&2
elif [[ -z "${account}" ]]; then
    need aws "install the AWS CLI v2 or pass --account"
    account="$(aws sts get-caller-identity --query Account --output text)" \
        || die "aws sts get-caller-identity failed: configure credentials or pass --account"
fi

# ---- validation ------------------------------------------------------------------------------

[[ ${#repository} -ge 2 && ${#repository} -le 256 && "${repository}" =~ ${REPOSITORY_RE} ]] \
    || die "invalid --repository '${repository}': 2-256 chars of lower-case letters, digits and ._-/ separators"
[[ "${tag}" =~ ${TAG_RE} ]] \
    || die "invalid --tag '${tag}': 1-128 chars of letters, digits, _ . - (not starting with . or -)"
[[ "${region}" =~ ${REGION_RE} ]] || die "invalid --region '${region}' (expected e.g. us-east-1)"
((account_placeholder)) || [[ "${account}" =~ ${ACCOUNT_RE} ]] || die "invalid --account '${account}': 12 digits"
[[ "${platform}" =~ ${PLATFORM_RE} ]] || die "invalid --platform '${platform}' (expected e.g. linux/amd64)"
[[ -n "${base_image}" && ! "${base_image}" =~ [[:space:]] ]] || die "invalid --base-image '${base_image}'"
for arg in "${build_args[@]+"${build_args[@]}"}"; do
    [[ "${arg}" =~ ${BUILD_ARG_RE} ]] || die "invalid --build-arg '${arg}': expected KEY=VALUE"
    [[ "${arg}" != BASE_IMAGE=* ]] || die "use --base-image, not --build-arg BASE_IMAGE=..."
done
if [[ -n "${hf_token_file}" && ! -r "${hf_token_file}" ]]; then
    die "--hf-token-file ${hf_token_file}: not a readable file"
fi
[[ -f "${DOCKERFILE}" ]] || die "${DOCKERFILE} not found"

domain="amazonaws.com"
[[ "${region}" != cn-* ]] || domain="amazonaws.com.cn"
registry="${account}.dkr.ecr.${region}.${domain}"
local_image="${repository}:${tag}"
remote_image="${registry}/${repository}:${tag}"

# ---- running (or printing) -----------------------------------------------------------------

# run CMD...: run a command, or print it shell-quoted under --dry-run.
run() {
    if ((dry_run)); then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

# ecr_login REGISTRY REGION: docker login to an ECR registry with a token from the AWS CLI.
ecr_login() {
    local login_registry="$1" login_region="$2"
    if ((dry_run)); then
        printf '+ aws ecr get-login-password --region %q | docker login --username AWS --password-stdin %q\n' \
            "${login_region}" "${login_registry}"
    else
        aws ecr get-login-password --region "${login_region}" \
            | docker login --username AWS --password-stdin "${login_registry}"
    fi
}

if ((dry_run == 0)); then
    need aws "install the AWS CLI v2"
    need docker "install Docker (with BuildKit)"
fi

echo "${PROG}: ${remote_image} (base ${base_image}, platform ${platform})" >&2

# 1. the ECR repository
if ((dry_run)); then
    run aws ecr describe-repositories --repository-names "${repository}" --region "${region}"
    echo "# if it does not exist:"
    run aws ecr create-repository --repository-name "${repository}" --region "${region}" \
        --image-scanning-configuration scanOnPush=true
elif ! aws ecr describe-repositories --repository-names "${repository}" --region "${region}" >/dev/null 2>&1; then
    echo "${PROG}: creating ECR repository ${repository} in ${region}" >&2
    aws ecr create-repository --repository-name "${repository}" --region "${region}" \
        --image-scanning-configuration scanOnPush=true >/dev/null
fi

# 2. registry logins: the base image's (an AWS Deep Learning Container lives in ECR) and ours
if [[ "${base_image}" =~ ${ECR_IMAGE_RE} ]]; then
    base_registry="${base_image%%/*}"
    base_region="${BASH_REMATCH[2]}"
    if [[ "${base_registry}" != "${registry}" ]]; then
        ecr_login "${base_registry}" "${base_region}"
    fi
fi
ecr_login "${registry}" "${region}"

# 3. build, tag, push
build=(docker build --platform "${platform}" --build-arg "BASE_IMAGE=${base_image}")
for arg in "${build_args[@]+"${build_args[@]}"}"; do
    build+=(--build-arg "${arg}")
done
if [[ -n "${hf_token_file}" ]]; then
    build+=(--secret "id=hf_token,src=${hf_token_file}")
fi
build+=(--tag "${local_image}" --file "${DOCKERFILE}" "${SCRIPT_DIR}")
run env DOCKER_BUILDKIT=1 "${build[@]}"
run docker tag "${local_image}" "${remote_image}"
run docker push "${remote_image}"

echo "${remote_image}"
