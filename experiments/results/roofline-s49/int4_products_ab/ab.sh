# The int4 products of two builds of models/kernels/native_kernels.cpp in one process,
# alternated call batch by call batch (40 trials), so the host's drift hits both alike.
# old: the kernels of 07bb1ba; new2: those of 661afbe (the shifts folded into
# the accumulator's lanes, each block's group from a table built once per product).
set -e
git show 07bb1ba:models/kernels/native_kernels.cpp > /tmp/old_kernels.cpp
git show 661afbe:models/kernels/native_kernels.cpp > /tmp/new2_kernels.cpp
mkdir -p /tmp/s49/ab
for v in old new2; do g++ -O3 -mavx2 -mfma -mf16c -fopenmp -shared -fPIC -o /tmp/s49/ab/$v.so /tmp/${v}_kernels.cpp; done
for th in 2 1; do echo "threads $th"; OMP_NUM_THREADS=$th python experiments/results/roofline-s49/int4_products_ab/ab_mm.py old,new2; done
