# The A side of benchmarks/device_ab.sh: revision $1's package and benchmarks (default HEAD) into .carry/base
# (git-ignored; carry it to the device).
set -e
rm -rf .carry/base && mkdir -p .carry/base
git archive "${1:-HEAD}" vllm_kimi_dsa $(git ls-tree -r --name-only "${1:-HEAD}" benchmarks | grep "\.py$") | tar -x -C .carry/base
echo "A = $(git rev-parse --short "${1:-HEAD}") in .carry/base"
