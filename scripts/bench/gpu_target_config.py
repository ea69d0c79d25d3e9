"""Writes this machine's GPU as a `GpuTargetConfigProto` text, like the H100 one jaxdp ships.

XLA compiles for a GPU it cannot see from such a description
(`get_topology_desc(platform="cuda", target_config=...)`, see `jaxdp._src.aot`). This reads
the hardware facts of device 0 from the CUDA runtime (through CuPy) and prints them in the
same fields as `jaxdp/_src/data/h100_target_config.txtpb`.

    python scripts/bench/gpu_target_config.py > h200_target_config.txtpb
"""

import cupy

props = cupy.cuda.runtime.getDeviceProperties(0)
major, minor = props["major"], props["minor"]
# Peak DRAM bandwidth: double data rate x memory clock (kHz) x bus width (bits) / 8.
clock_khz = props.get("memoryClockRate") or cupy.cuda.runtime.deviceGetAttribute(
  cupy.cuda.runtime.cudaDevAttrMemoryClockRate, 0
)
bus_bits = props.get("memoryBusWidth") or cupy.cuda.runtime.deviceGetAttribute(
  cupy.cuda.runtime.cudaDevAttrGlobalMemoryBusWidth, 0
)
sm_clock_khz = props.get("clockRate") or cupy.cuda.runtime.deviceGetAttribute(
  cupy.cuda.runtime.cudaDevAttrClockRate, 0
)
runtime = cupy.cuda.runtime.runtimeGetVersion()
name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
grid = props["maxGridSize"]
print(f"""gpu_device_info {{
  threads_per_block_limit: {props["maxThreadsPerBlock"]}
  threads_per_warp: {props["warpSize"]}
  shared_memory_per_block: {props["sharedMemPerBlock"]}
  shared_memory_per_core: {props["sharedMemPerMultiprocessor"]}
  threads_per_core_limit: {props["maxThreadsPerMultiProcessor"]}
  core_count: {props["multiProcessorCount"]}
  fpus_per_core: 128
  block_dim_limit_x: {grid[0]}
  block_dim_limit_y: {grid[1]}
  block_dim_limit_z: {grid[2]}
  memory_bandwidth: {2 * clock_khz * 1000 * bus_bits // 8}
  l2_cache_size: {props["l2CacheSize"]}
  clock_rate_ghz: {sm_clock_khz / 1e6:.2f}
  device_memory_size: {props["totalGlobalMem"]}
  shared_memory_per_block_optin: {props["sharedMemPerBlockOptin"]}
  cuda_compute_capability {{ major: {major}{f" minor: {minor}" if minor else ""} }}
  registers_per_core_limit: {props["regsPerMultiprocessor"]}
  registers_per_block_limit: {props["regsPerBlock"]}
}}
platform_name: "CUDA"
runtime_version {{ major: {runtime // 1000} minor: {runtime % 1000 // 10} }}
device_description_str: "{name}\"""")
