source .device-kit/install.sh >/dev/null; export PYTHONUNBUFFERED=1
timeout 190 python3 -m pytest -m gpu -n 12 -q -p no:cacheprovider tests/test_varlen.py tests/test_transformers_models.py tests/test_decode.py > $OUT/varlen-tests.log 2>&1; echo "tests rc=$?"
timeout 110 python3 benchmarks/varlen_modifiers.py --out $OUT/varlen-targets.txt > $OUT/varlen-bench.log 2>&1; echo "bench rc=$?"
echo done
