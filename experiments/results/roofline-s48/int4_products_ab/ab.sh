cd /work/main && source .venv/bin/activate
cp models/kernels/native_kernels.cpp /tmp/s48/new_kernels.cpp
for i in 1 2 3 4; do
  for v in old new; do
    if [ $v = old ]; then git show 6a1f6e0:models/kernels/native_kernels.cpp > models/kernels/native_kernels.cpp; else cp /tmp/s48/new_kernels.cpp models/kernels/native_kernels.cpp; fi
    python /tmp/s48/mm_bench.py 1 2 2>&1 | grep -v building | sed "s/^/$v /"
  done
done
cp /tmp/s48/new_kernels.cpp models/kernels/native_kernels.cpp
