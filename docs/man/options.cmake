# cmake -DSPD=path/to/spd -DOUT=file.h2m -P options.cmake
#
# spd(8)'s CONFIGURATION section, from the option table as `spd --dump-config`
# prints it with nothing set (a clean environment, no file): for each option
# its name, its default and its documentation. help2man includes it as it is,
# so the text is escaped for roff here.
execute_process(COMMAND env -i ${SPD} --dump-config OUTPUT_VARIABLE dump RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${SPD} --dump-config failed (${rc})")
endif()

function(roff_escape var text)
  string(REPLACE "\\" "\\e" text "${text}")
  string(REPLACE "-" "\\-" text "${text}")
  string(REGEX REPLACE "^([.'])" "\\\\&\\1" text "${text}")
  set(${var} "${text}" PARENT_SCOPE)
endfunction()

set(out "[CONFIGURATION]\n")
string(APPEND out "Each option is set, a later place winning over an earlier one, in the file given by "
                  "\\fB\\-\\-config\\fR (lines \\fIname value\\fR; # starts a comment), in the environment "
                  "as \\fBSPD_\\fINAME\\fR (upper case), or with \\fB\\-\\-set\\fR \\fIname\\fB=\\fIvalue\\fR. "
                  "Sizes take K, M, G and T. The options, with their defaults:\n")
# One list item per line: the characters CMake's lists read (; [ ]) stand in
# for themselves until each item is written.
string(REPLACE ";" "@SEMI@" dump "${dump}")
string(REPLACE "[" "@LB@" dump "${dump}")
string(REPLACE "]" "@RB@" dump "${dump}")
string(REPLACE "\n" ";" lines "${dump}")
set(doc "")
foreach(line IN LISTS lines)
  if(line MATCHES "^# (.*)$")
    set(doc "${CMAKE_MATCH_1}")
  elseif(line MATCHES "^([a-z_]+) (.*)$")
    roff_escape(name "${CMAKE_MATCH_1}")
    roff_escape(value "${CMAKE_MATCH_2}")
    roff_escape(text "${doc}")
    string(APPEND out ".TP\n\\fB${name}\\fR ${value}\n${text}\n")
    set(doc "")
  endif()
endforeach()
string(REPLACE "@SEMI@" ";" out "${out}")
string(REPLACE "@LB@" "[" out "${out}")
string(REPLACE "@RB@" "]" out "${out}")
file(WRITE ${OUT} "${out}")
