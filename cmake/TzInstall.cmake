# Install rules and the CMake package: `cmake --install build --prefix P` puts the CLI in P/bin,
# libtierzero.so in P/lib, the public headers in P/include/tierzero and the package in
# P/lib/cmake/tierzero, so another project can `find_package(tierzero)` and link
# tierzero::tierzero (examples/embed; docs/embedding.md).
include(CMakePackageConfigHelpers)

install(TARGETS tierzero_lib EXPORT tierzeroTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/tierzero
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
install(TARGETS tierzero RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
set_target_properties(tierzero PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)

set(TZ_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/tierzero)
install(EXPORT tierzeroTargets NAMESPACE tierzero:: DESTINATION ${TZ_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/tierzeroConfig.cmake.in
  ${PROJECT_BINARY_DIR}/tierzeroConfig.cmake INSTALL_DESTINATION ${TZ_CMAKE_DIR})
# 0.x: minor versions may break the API, so a consumer asking for 0.1 accepts only 0.1.*.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tierzeroConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/tierzeroConfig.cmake
              ${PROJECT_BINARY_DIR}/tierzeroConfigVersion.cmake
  DESTINATION ${TZ_CMAKE_DIR})
