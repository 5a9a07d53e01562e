# Finds the project's dependencies. Every required one is a Debian package installed by
# scripts/setup; CUDA comes from /usr/local/cuda when present.
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
find_package(TBB REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
# Debian's oneDNN is built with its OpenCL runtime, and its CMake package fails without the
# OpenCL headers and library (ocl-icd-opencl-dev, only a Recommends of libdnnl-dev). Say so first,
# since the error it gives names neither.
find_package(OpenCL QUIET)
if(NOT OpenCL_FOUND AND EXISTS /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/dnnl)
  message(WARNING "OpenCL was not found, which Debian's oneDNN CMake package requires: install "
                  "ocl-icd-opencl-dev (scripts/setup installs every dependency)")
endif()
find_package(dnnl REQUIRED)  # oneDNN: the GPT's CPU matrix products
find_package(OpenMP REQUIRED COMPONENTS CXX)  # oneDNN's threading runtime (Note [Matrix products under oneTBB])
pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)
if(TZ_USE_JEMALLOC)
  pkg_check_modules(JEMALLOC REQUIRED IMPORTED_TARGET jemalloc)
endif()

# ---- CUDA ------------------------------------------------------------------------------------
set(TZ_HAVE_CUDA OFF)
if(NOT TZ_ENABLE_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # sm_90 machine code plus compute_90 PTX, which the driver JIT-compiles for newer GPUs.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90-real 90-virtual)
    endif()
    # CMake 3.25 does not know nvcc's C++20 flag, so CUDA sources are C++17 (headers they
    # include must stay C++17-clean).
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
    # Debian 12's CMake 3.25.1 FindCUDAToolkit sets a deprecation property on CUDA::nvToolsExt
    # without checking that the target exists, whenever the project requires CMake >= 3.25; the
    # CUDA 13 Toolkit no longer ships libnvToolsExt, so configure fails there ("set_property could
    # not find TARGET CUDA::nvToolsExt"; fixed in later CMake). That block only adds the warning,
    # so the module is run as for an older minimum and the variable put back afterwards.
    set(_tz_cmake_minimum ${CMAKE_MINIMUM_REQUIRED_VERSION})
    set(CMAKE_MINIMUM_REQUIRED_VERSION 3.24)
    find_package(CUDAToolkit REQUIRED)
    set(CMAKE_MINIMUM_REQUIRED_VERSION ${_tz_cmake_minimum})
    unset(_tz_cmake_minimum)
    set(TZ_HAVE_CUDA ON)
  elseif(TZ_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TZ_ENABLE_CUDA=ON but nvcc was not found (looked in PATH and /usr/local/cuda/bin)")
  else()
    message(STATUS "tierzero: nvcc not found, building without CUDA")
  endif()
endif()

# ---- MPI -------------------------------------------------------------------------------------
set(TZ_HAVE_MPI OFF)
if(NOT TZ_ENABLE_MPI STREQUAL "OFF")
  find_package(MPI COMPONENTS C)
  if(MPI_C_FOUND)
    set(TZ_HAVE_MPI ON)
  elseif(TZ_ENABLE_MPI STREQUAL "ON")
    message(FATAL_ERROR "TZ_ENABLE_MPI=ON but MPI was not found (apt-get install libopenmpi-dev)")
  endif()
endif()

if(TZ_BUILD_TESTS)
  find_package(GTest REQUIRED)
  include(GoogleTest)
endif()
if(TZ_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
