#include "emu.h"
thread_local dim3 threadIdx, blockIdx;
dim3 gridDim, blockDim;
EmuBlock* emu_block;

void emu_launch(dim3 grid, dim3 block, const std::function<void()>& kernel) {
    unsigned n = block.x;
    gridDim = grid; blockDim = block;
    std::barrier<> bar(n), end(n);
    EmuBlock b;
    b.block_bar = &bar;
    for (unsigned w = 0; w < (n + 31) / 32; w++) b.warp_bars.emplace_back(new std::barrier<>(32));
    b.xchg.assign(n, 0);
    emu_block = &b;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < n; t++)
        ts.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            for (unsigned z = 0; z < grid.z; z++)
                for (unsigned y = 0; y < grid.y; y++)
                    for (unsigned x = 0; x < grid.x; x++) {
                        blockIdx = {x, y, z};
                        kernel();
                        end.arrive_and_wait();
                    }
        });
    for (auto& t : ts) t.join();
}
