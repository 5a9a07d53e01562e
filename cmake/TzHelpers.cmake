# tz_module(NAME SOURCES ... [DEPS ...]): one static library per src/<module>, with include
# paths written from src/ (#include "core/status.h") and the public include/ directory.
function(tz_module name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(tz_${name} STATIC ${ARG_SOURCES})
  target_include_directories(tz_${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/src>
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>)
  target_link_libraries(tz_${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
endfunction()

# tz_simd_sources(TARGET LEVEL SOURCES...): compiles SOURCES of TARGET with the flags of one
# instruction-set level. Only these files may use the instructions; callers dispatch at run time.
function(tz_simd_sources target level)
  if(level STREQUAL "avx2")
    set(flags -mavx2 -mfma -mf16c)
  elseif(level STREQUAL "avx512")
    set(flags -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -Wno-maybe-uninitialized)
  elseif(level STREQUAL "avx512bf16")
    set(flags -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c
              -Wno-maybe-uninitialized)
  else()
    message(FATAL_ERROR "unknown SIMD level ${level}")
  endif()
  target_sources(${target} PRIVATE ${ARGN})
  set_source_files_properties(${ARGN} TARGET_DIRECTORY ${target} PROPERTIES COMPILE_OPTIONS "${flags}")
endfunction()

# tz_test(NAME SOURCES... DEPS ...): one GoogleTest binary, discovered into ctest.
function(tz_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 300)
endfunction()
