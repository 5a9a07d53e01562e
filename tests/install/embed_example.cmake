# cmake -P script for the install.embed_example test (see CMakeLists.txt).
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " cmd)
    message(FATAL_ERROR "failed (${rc}): ${cmd}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
foreach(f include/tierzero/engine.h lib/cmake/tierzero/tierzeroConfig.cmake bin/tierzero)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "the install is missing ${f}")
  endif()
endforeach()

# Every function the public headers declare is in the library (a module's object file that the
# engine itself never calls would otherwise be left out of it).
find_program(NM nm REQUIRED)
file(GLOB lib ${prefix}/lib/libtierzero.so.*.*.*)
execute_process(COMMAND ${NM} -DC --defined-only ${lib} OUTPUT_VARIABLE symbols)
foreach(fn Version InitNormal InitConstant ReadCheckpointInfo CastElements ParseByteSize
           FormatBytes FormatBandwidth FirstInvalidUtf8 ParseDType DTypeName ListDevices
           ListTunables ValidateTunables AllGatherBytes AgreeOnStatus ActiveSimdLevel
           SimdLevelName ReadReportFile ReportSummary WriteChromeTrace WriteHtmlReport
           WriteTextFile Communicator::Mpi Communicator::Single ReadSafetensorsMetadata
           SafetensorsTensorsEqual)
  if(NOT symbols MATCHES "tierzero::${fn}(\\[abi:cxx11\\])?\\(")
    message(FATAL_ERROR "libtierzero.so does not define the public tierzero::${fn}")
  endif()
endforeach()

set(launcher)
if(LAUNCHER)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()
# A sanitized libtierzero needs its runtime first in the program: the example is built with the
# same flags (the asan preset).
set(flags)
if(SANITIZE)
  set(flags "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined")
endif()
run(${CMAKE_COMMAND} -S ${EXAMPLE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release ${launcher} ${flags})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
# The example exits non-zero unless its loss fell 20-fold; the report and its page must be written too.
run(${WORK_DIR}/build/embed_mlp ${WORK_DIR}/report.json ${WORK_DIR}/report.html)
foreach(f report.json report.html)
  if(NOT EXISTS ${WORK_DIR}/${f})
    message(FATAL_ERROR "embed_mlp wrote no ${f}")
  endif()
endforeach()
file(READ ${WORK_DIR}/report.html page)
if(NOT page MATCHES "tierzero-report")
  message(FATAL_ERROR "embed_mlp's report.html does not carry the report")
endif()
